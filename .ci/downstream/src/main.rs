//! Uses rope-cuda's public API from a stable-Rust crate.

use rope_cuda::{Error, HostTable};

fn main() -> Result<(), Error> {
    let table = HostTable::new(128, 10_000.0, 16)?;
    let archs: Vec<&str> = rope_cuda::archs().collect();
    assert_eq!(archs, ["sm_80", "sm_90", "sm_100"], "the PTX of every architecture is embedded");
    for arch in &archs {
        let ptx = rope_cuda::ptx(arch).expect("embedded");
        // A user's build ships only the library's kernels: no benchmark yardsticks.
        assert!(!ptx.contains(".entry bench_"), "the benchmark kernels are in a user's PTX");
        assert!(ptx.contains(".entry kv_") && ptx.contains(&format!(".target {arch}")), "{arch}");
        println!("rope-cuda: {} bytes of PTX for {arch}", ptx.len());
    }
    println!("table {}x{}", table.max_position, table.half);
    match cust::quick_init() {
        Ok(_ctx) => println!("a CUDA device is present"),
        Err(e) => println!("no CUDA device ({e})"),
    }
    Ok(())
}
