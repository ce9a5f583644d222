//! Uses rope-cuda's public API from a stable-Rust crate.

use rope_cuda::{Error, HostTable, PTX};

fn main() -> Result<(), Error> {
    let table = HostTable::new(128, 10_000.0, 16)?;
    // A user's build ships only the library's kernels: no benchmark yardsticks.
    assert!(!PTX.contains(".entry bench_"), "the benchmark kernels are in a user's PTX");
    assert!(PTX.contains(".entry kv_"), "the KV kernels are missing from the PTX");
    println!("rope-cuda: {} bytes of PTX for {}, table {}x{}", PTX.len(), rope_cuda::ARCH, table.max_position, table.half);
    match cust::quick_init() {
        Ok(_ctx) => println!("a CUDA device is present"),
        Err(e) => println!("no CUDA device ({e})"),
    }
    Ok(())
}
