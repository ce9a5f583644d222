//! Uses rope-cuda's public API from a stable-Rust crate.

use rope_cuda::{Error, HostTable, PTX};

fn main() -> Result<(), Error> {
    let table = HostTable::new(128, 10_000.0, 16)?;
    println!("rope-cuda: {} bytes of PTX for {}, table {}x{}", PTX.len(), rope_cuda::ARCH, table.max_position, table.half);
    match cust::quick_init() {
        Ok(_ctx) => println!("a CUDA device is present"),
        Err(e) => println!("no CUDA device ({e})"),
    }
    Ok(())
}
