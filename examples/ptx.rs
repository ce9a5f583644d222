//! Prints the embedded PTX of one architecture, for offline checks (`.ci/run` feeds each to
//! ptxas): `cargo run --example ptx -- sm_90` (default: the oldest embedded, sm_80).

fn main() {
    let arch = std::env::args().nth(1).unwrap_or_else(|| rope_cuda::archs().next().expect("PTX embedded").to_string());
    match rope_cuda::ptx(&arch) {
        Some(text) => print!("{text}"),
        None => {
            let embedded: Vec<_> = rope_cuda::archs().collect();
            eprintln!("no PTX for {arch} (embedded: {})", embedded.join(", "));
            std::process::exit(2);
        }
    }
}
