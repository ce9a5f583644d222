//! Prints the embedded PTX, for offline checks (`.ci/run` feeds it to ptxas):
//!
//! ```text
//! cargo run --example ptx > kernels.ptx
//! ```

fn main() {
    print!("{}", rope_cuda::PTX);
}
