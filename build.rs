//! Compiles `kernels/` to PTX with rustc's NVPTX backend and leaves it in `OUT_DIR` for the
//! host library to embed. This plays the part `cuda_builder` would (see README.md, "Why not
//! cuda_builder / cuda_std").
//!
//! The kernel build is a nested `cargo` run on the pinned nightly, in a clean environment
//! (nothing of the outer build's `RUSTFLAGS`, `RUSTC`, wrappers or target dir leaks in), with
//! its own target dir under `OUT_DIR`. Only that nested run needs the nightly, so a crate built
//! with stable Rust can depend on `rope-cuda`.
//!
//! The kernel crate's sources are found through its `links` metadata (`DEP_ROPE_CUDA_KERNELS_ROOT`,
//! so the same script works in the repository and in a crate unpacked from its `.crate`), and
//! copied into `OUT_DIR` as a workspace of their own before they are built there: nothing is
//! written next to the sources, which may be read-only.
//!
//! It builds the PTX for each architecture of `ARCHS` (sm_80, sm_90, sm_100), cuts each into
//! one module per entry point, packs them (`ptx-{arch}.bin`: groups of 16 similar entry points,
//! one brotli stream a group, sm_80's and sm_100's groups against sm_90's same group) and
//! writes the index the host reads them by (`ptx_index.rs`): the host loads the newest
//! architecture the device runs, and each entry point's module on its first launch. The PTX
//! and the packed output are cached in the target dir (`rope-cuda-ptx`). The feature `bench-kernels` adds the
//! benchmark kernels (this crate's own tests, benches and examples ask for it).
//!
//! Settings: `ROPE_CUDA_ARCH` (default: every architecture of `ARCHS`; one, or a
//! comma-separated list, builds only those) and `ROPE_CUDA_KERNEL_TOOLCHAIN` (default: the
//! channel of `rust-toolchain.toml`). Where `DOCS_RS` is set (docs.rs: no GPU toolchain) or
//! `ROPE_CUDA_SKIP_PTX` (local docs and checks: `ROPE_CUDA_SKIP_PTX=1 cargo doc`), no PTX is
//! embedded, and a binary built so loads no kernel (`Kernels::load` returns `Error::Arch`,
//! nothing embedded). Set `ROPE_CUDA_SKIP_PTX`, not `DOCS_RS`, outside docs.rs: cust_raw's build
//! script, under `DOCS_RS`, records neither `-lcuda` nor a rerun trigger, so a later plain build
//! in the same target directory fails to link.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

/// The toolchain the kernels are verified with; `rust-toolchain.toml` names the same.
const TOOLCHAIN: &str = "nightly-2026-10-15";
/// Components the kernel build needs from that toolchain.
const COMPONENTS: [&str; 3] = ["rust-src", "llvm-tools", "llvm-bitcode-linker"];
const TARGET: &str = "nvptx64-nvidia-cuda";
const CRATE: &str = "rope_cuda_kernels";

/// The architectures whose PTX is built and embedded, oldest first: the host loads the newest
/// one the device runs. sm_80 (Ampere, and Ada through the driver's JIT), sm_90 (Hopper),
/// sm_100 (Blackwell).
const ARCHS: [&str; 3] = ["sm_80", "sm_90", "sm_100"];

fn main() {
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let source = PathBuf::from(env::var("DEP_ROPE_CUDA_KERNELS_ROOT").expect("rope-cuda-kernels sets its root"));
    println!("cargo:rerun-if-changed={}", source.join("src").display());
    println!("cargo:rerun-if-changed={}", source.join("Cargo.toml").display());
    println!("cargo:rerun-if-env-changed=DOCS_RS");
    println!("cargo:rerun-if-env-changed=ROPE_CUDA_SKIP_PTX");
    // The cudarc API comes with either feature: `cudarc`, or `candle`, whose CUDA tensors hold
    // cudarc's buffers.
    println!("cargo:rustc-check-cfg=cfg(rope_cudarc)");
    if env::var_os("CARGO_FEATURE_CUDARC").is_some() || env::var_os("CARGO_FEATURE_CANDLE").is_some() {
        println!("cargo:rustc-cfg=rope_cudarc");
    }
    if env::var_os("DOCS_RS").is_some() || env::var_os("ROPE_CUDA_SKIP_PTX").is_some() {
        write_packed(&out, &[]);
        return;
    }
    println!("cargo:rerun-if-env-changed=ROPE_CUDA_ARCH");
    println!("cargo:rerun-if-env-changed=ROPE_CUDA_KERNEL_TOOLCHAIN");

    // `ROPE_CUDA_ARCH=sm_80` (or a list, `sm_80,sm_90`) builds only those: for a quicker
    // build while working on the kernels, or to compare one architecture's PTX alone.
    let archs: Vec<String> = match env::var("ROPE_CUDA_ARCH") {
        Ok(v) => v.split(',').map(|a| a.trim().to_string()).collect(),
        Err(_) => ARCHS.iter().map(|a| a.to_string()).collect(),
    };
    for arch in &archs {
        if !ARCHS.contains(&arch.as_str()) {
            fail(&format!("ROPE_CUDA_ARCH names {arch:?}; the kernels are built for {}", ARCHS.join(", ")));
        }
    }
    let toolchain = env::var("ROPE_CUDA_KERNEL_TOOLCHAIN").unwrap_or_else(|_| TOOLCHAIN.to_string());
    check_toolchain(&toolchain);

    let kernels = out.join("kernels-src");
    let cache = Cache::new(&out, &source, &toolchain);
    // The packed PTX of these kernels and architectures, if a build before this one packed it.
    if cache.unpack(&archs, &out) {
        return;
    }
    // The primary architecture (sm_90 where it is built) first: its groups are made first, and
    // each is the dictionary of the other architectures' same group.
    let mut order: Vec<&String> = archs.iter().collect();
    if let Some(i) = order.iter().position(|a| a.as_str() == PRIMARY) {
        order[..=i].rotate_right(1);
    }
    let mut copied = false;
    let mut packer = Packer::default();
    for arch in order {
        let ptx = cache.get(arch).unwrap_or_else(|| {
            if !copied {
                copy_crate(&source, &kernels);
                copied = true;
            }
            let ptx = build_ptx(&kernels, &out, &toolchain, arch);
            cache.put(arch, &ptx);
            ptx
        });
        // Packed on other threads while the next architecture builds (that build is mostly
        // one thread: the kernel crate is one codegen unit).
        packer.add(arch, &ptx);
    }
    let packed = packer.finish(&archs);
    cache.store_pack(&archs, &packed);
    write_packed(&out, &packed);
}

/// The PTX already built, shared by every build of this crate in one target dir: a test
/// build, a clippy run, the docs and an example with the same kernel sources, toolchain and
/// features take it from here instead of building it again (each build of all architectures
/// takes minutes). An entry is named by a hash of everything the kernel build reads (the
/// kernel crate's files, the toolchain's `rustc -V`, the features, the architecture). The
/// nested builds keep their own target dirs under `OUT_DIR`: two builds that miss at once
/// each build theirs, and the entry each stores is the same.
struct Cache {
    /// `rope-cuda-ptx` in the target dir (beside the profiles' dirs), or `OUT_DIR` where its
    /// layout is not the usual one.
    dir: PathBuf,
    key: u64,
}

impl Cache {
    fn new(out: &Path, source: &Path, toolchain: &str) -> Cache {
        // OUT_DIR is <target>[/<triple>]/<profile>/build/<package>-<hash>/out (or, in cargo's
        // newer layout, .../build/<package>/<hash>/out): the entries go beside the profiles.
        let build = out.ancestors().take(4).find(|a| a.file_name().is_some_and(|n| n == "build"));
        let dir = match build.and_then(Path::parent).and_then(Path::parent) {
            Some(target) => target.join("rope-cuda-ptx"),
            None => out.to_path_buf(),
        };
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| fail(&format!("creating {}: {e}", dir.display())));
        let mut h = Fnv::default();
        let rustc =
            Command::new("rustup").args(["run", toolchain, "rustc", "-V"]).env_remove("RUSTUP_TOOLCHAIN").output();
        h.add(&rustc.map(|o| o.stdout).unwrap_or_default());
        h.add(toolchain.as_bytes());
        h.add(&[env::var_os("CARGO_FEATURE_BENCH_KERNELS").is_some() as u8]);
        let mut files = Vec::new();
        list_files(&source.join("src"), &mut files);
        files.sort();
        files.push(source.join("build.rs"));
        files.push(source.join("Cargo.toml"));
        for f in files {
            h.add(f.strip_prefix(source).unwrap_or(&f).to_string_lossy().as_bytes());
            h.add(&std::fs::read(&f).unwrap_or_else(|e| fail(&format!("reading {}: {e}", f.display()))));
        }
        Cache { dir, key: h.0 }
    }

    fn path(&self, arch: &str) -> PathBuf {
        self.dir.join(format!("{:016x}-{arch}.ptx", self.key))
    }

    fn get(&self, arch: &str) -> Option<String> {
        std::fs::read_to_string(self.path(arch)).ok()
    }

    /// Stores an entry whole or not at all (written aside, then renamed): a build that stops
    /// halfway, or one running beside it, never reads half a file.
    fn put(&self, arch: &str, ptx: &str) {
        self.write(&self.path(arch), ptx.as_bytes());
    }

    fn write(&self, path: &Path, bytes: &[u8]) {
        let tmp = path.with_extension(format!("{}.tmp", std::process::id()));
        std::fs::write(&tmp, bytes).unwrap_or_else(|e| fail(&format!("writing {}: {e}", tmp.display())));
        std::fs::rename(&tmp, path).unwrap_or_else(|e| fail(&format!("renaming {}: {e}", tmp.display())));
    }

    /// The packed PTX's files for `archs`: each blob, then the index (named by the kernels'
    /// key, the architectures and [`PACKING`]). Packing all three takes minutes on two cores:
    /// every build in the target dir but the first takes it from here.
    fn pack_paths(&self, archs: &[String]) -> (Vec<PathBuf>, PathBuf) {
        let mut h = Fnv::default();
        h.add(&self.key.to_le_bytes());
        h.add(PACKING.as_bytes());
        archs.iter().for_each(|a| h.add(a.as_bytes()));
        let blobs = archs.iter().map(|a| self.dir.join(format!("{:016x}-{a}.bin", h.0))).collect();
        (blobs, self.dir.join(format!("{:016x}-index.rs", h.0)))
    }

    /// Copies the packed PTX of `archs` into `out`, if a build packed it before.
    fn unpack(&self, archs: &[String], out: &Path) -> bool {
        let (blobs, index) = self.pack_paths(archs);
        let Ok(index) = std::fs::read_to_string(index) else { return false };
        let Ok(blobs) = blobs.iter().map(std::fs::read).collect::<Result<Vec<_>, _>>() else { return false };
        for (arch, blob) in archs.iter().zip(blobs) {
            write_bytes_if_changed(&out.join(format!("ptx-{arch}.bin")), &blob);
        }
        write_if_changed(&out.join("ptx_index.rs"), &index);
        true
    }

    /// Stores the packed PTX (the index last: an index names blobs that are all there).
    fn store_pack(&self, archs: &[String], packed: &[PackedArch]) {
        let (blobs, index_path) = self.pack_paths(archs);
        for (path, a) in blobs.iter().zip(packed) {
            self.write(path, &a.blob);
        }
        self.write(&index_path, index(packed).as_bytes());
    }
}

/// FNV-1a, 64 bits, with each part's length mixed in (parts cannot run into each other).
#[derive(Default)]
struct Fnv(u64);

impl Fnv {
    fn add(&mut self, bytes: &[u8]) {
        if self.0 == 0 {
            self.0 = 0xcbf2_9ce4_8422_2325;
        }
        for &b in (bytes.len() as u64).to_le_bytes().iter().chain(bytes) {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
}

fn list_files(dir: &Path, files: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| fail(&format!("reading {}: {e}", dir.display())));
    for entry in entries {
        let path = entry.unwrap_or_else(|e| fail(&format!("reading {}: {e}", dir.display()))).path();
        if path.is_dir() {
            list_files(&path, files);
        } else {
            files.push(path);
        }
    }
}

/// Builds the kernel crate's PTX for `arch` (a target dir of its own: `core` is built per
/// architecture) and returns its text.
fn build_ptx(kernels: &Path, out: &Path, toolchain: &str, arch: &str) -> String {
    let target_dir = out.join(format!("kernels-target-{arch}"));
    let mut cmd = Command::new("rustup");
    cmd.args(["run", toolchain, "cargo", "build", "--release", "--lib"])
        .args(["--target", TARGET, "-Zbuild-std=core"])
        // The benchmark kernels only for builds that ask for them (this crate's own tests,
        // benches and examples): a user's PTX holds only what the library launches.
        .args(if env::var_os("CARGO_FEATURE_BENCH_KERNELS").is_some() { &["--features", "bench"][..] } else { &[] })
        .arg("--manifest-path")
        .arg(kernels.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&target_dir)
        // Profile settings for the device build only; the workspace's own profiles stay as
        // they are (unwinding) for host builds.
        .args(["--config", "profile.release.panic=\"abort\""])
        .args(["--config", "profile.release.lto=true"])
        .args(["--config", "profile.release.codegen-units=1"])
        .args(["--config", "profile.release.opt-level=3"])
        .args(["--config", "profile.release.debug=false"]);
    for (key, _) in env::vars_os() {
        let key = key.to_string_lossy();
        if key.starts_with("CARGO") || key.starts_with("RUST") {
            cmd.env_remove(key.as_ref());
        }
    }
    cmd.env("RUSTUP_TOOLCHAIN", toolchain).env("RUSTFLAGS", format!("-C target-cpu={arch}"));

    let status = cmd.status().unwrap_or_else(|e| fail(&format!("could not run `rustup run {toolchain} cargo`: {e}")));
    if !status.success() {
        fail(&format!("the kernel build for {TARGET} ({arch}) failed; its output is above"));
    }
    let ptx = target_dir.join(TARGET).join("release").join(format!("{CRATE}.ptx"));
    std::fs::read_to_string(&ptx).unwrap_or_else(|e| fail(&format!("reading {}: {e}", ptx.display())))
}

/// One architecture's PTX cut into modules: its prologue (`.version`, `.target`, the shared
/// declarations: everything before the first entry) and each entry point's text, from its
/// `.visible .entry` line to the `}` that closes it. The kernels call no `.func`s (everything
/// is inlined), so the prologue and one entry's text make a module of their own.
fn split_ptx(ptx: &str) -> (&str, Vec<(&str, &str)>) {
    let mut entries: Vec<(&str, usize, Option<usize>)> = Vec::new();
    let mut prologue = None;
    let mut at = 0;
    for line in ptx.split_inclusive('\n') {
        if let Some(rest) = line.strip_prefix(".visible .entry ") {
            let name = rest.split('(').next().unwrap_or_default().trim();
            prologue.get_or_insert(at);
            entries.push((name, at, None));
        } else if line.trim_end() == "}" {
            if let Some(e) = entries.last_mut().filter(|e| e.2.is_none()) {
                e.2 = Some(at + line.len());
            }
        } else if line.starts_with('.') && prologue.is_some() {
            fail(&format!("the PTX has a top-level line after its first entry point: {line:?}"));
        }
        at += line.len();
    }
    let entries = entries
        .into_iter()
        .map(|(name, start, end)| {
            let end = end.unwrap_or_else(|| fail(&format!("the PTX entry {name} has no closing brace")));
            (name, &ptx[start..end])
        })
        .collect();
    (&ptx[..prologue.unwrap_or(ptx.len())], entries)
}

/// The architecture whose groups are packed alone; every other architecture's group is packed
/// with the same group of this one as its dictionary (the same kernels, other instructions'
/// spellings: sm_80's and sm_100's PTX differ from sm_90's in few lines). Where it is not built
/// (`ROPE_CUDA_ARCH`), the first one built takes its part.
const PRIMARY: &str = "sm_90";
/// Entry points a group: one brotli stream each. A first launch decodes its group (about 1.5
/// MB of text, a few milliseconds); larger groups pack a little smaller and decode longer.
const GROUP: usize = 16;
/// brotli's quality for the primary's groups and for the others' (against their dictionary:
/// most of their text is found there, and quality 10's optimal parsing, 30 times the work of
/// 9's, gains little more), and its window (log2 bytes: a group and its dictionary fit).
const QUALITY: (i32, i32) = (10, 9);
const WINDOW: i32 = 24;
/// Names the packing (part of the packed output's cache key): change it with the packing.
const PACKING: &str = "brotli q10/q9 w24, groups of 16 by MinHash similarity, sm_90 the dictionary";

/// One architecture's PTX as packed: the blob `ptx-{arch}.bin` and its index line.
struct PackedArch {
    arch: String,
    blob: Vec<u8>,
    /// Each stream's byte range in the blob and its text's length: the prologue, then groups.
    prologue: (usize, usize, usize),
    groups: Vec<(usize, usize, usize)>,
    /// The architecture (its index among those built) whose groups are the dictionaries.
    base: Option<usize>,
    /// Each entry point in the PTX's order: name, group, offset and length in the group's text.
    entries: Vec<(String, usize, usize, usize)>,
}

/// Packed groups: each group's index and stream.
type Streams = Vec<(usize, Vec<u8>)>;

/// One architecture split and queued: its streams pack on threads of their own.
struct Pending {
    arch: String,
    /// The prologue packed, and its text's length.
    prologue: (Vec<u8>, usize),
    entries: Vec<(String, usize, usize, usize)>,
    /// Each group's text's length.
    lens: Vec<usize>,
    /// The threads packing its groups: each returns its groups' streams (group, bytes).
    jobs: Vec<std::thread::JoinHandle<Streams>>,
}

/// Packs each architecture's PTX as it comes (the primary first): the entry points in groups
/// of [`GROUP`] similar ones, each group one brotli stream; the same groups for every
/// architecture.
#[derive(Default)]
struct Packer {
    names: Option<Vec<String>>,
    groups: Option<Vec<Vec<usize>>>,
    primary: Option<(String, Arc<Vec<Vec<u8>>>)>,
    pending: Vec<Pending>,
}

impl Packer {
    fn add(&mut self, arch: &str, ptx: &str) {
        let (prologue, entries) = split_ptx(ptx);
        let listed: Vec<String> = entries.iter().map(|e| e.0.to_string()).collect();
        if self.names.get_or_insert_with(|| listed.clone()) != &listed {
            fail(&format!("the PTX for {arch} has other entry points than the first architecture's"));
        }
        let groups = self.groups.get_or_insert_with(|| similar_groups(&entries));
        let mut index = vec![(String::new(), 0, 0, 0); entries.len()];
        let mut texts = Vec::with_capacity(groups.len());
        for (g, members) in groups.iter().enumerate() {
            let mut text = Vec::new();
            for &i in members {
                let (name, body) = entries[i];
                index[i] = (name.to_string(), g, text.len(), body.len());
                text.extend_from_slice(body.as_bytes());
            }
            texts.push(text);
        }
        let lens = texts.iter().map(Vec::len).collect();
        let texts = Arc::new(texts);
        let quality = if self.primary.is_some() { QUALITY.1 } else { QUALITY.0 };
        let dict = match &self.primary {
            Some((_, primary)) => Some(Arc::clone(primary)),
            None => {
                self.primary = Some((arch.to_string(), Arc::clone(&texts)));
                None
            }
        };
        // `NUM_JOBS` threads an architecture (cargo's -j), interleaved over the groups.
        let threads = env::var("NUM_JOBS").ok().and_then(|n| n.parse().ok()).unwrap_or(2usize).clamp(1, 16);
        let jobs = (0..threads)
            .map(|t| {
                let (texts, dict) = (Arc::clone(&texts), dict.clone());
                std::thread::spawn(move || {
                    (t..texts.len())
                        .step_by(threads)
                        .map(|g| (g, brotli(&texts[g], dict.as_ref().map_or(&[][..], |d| &d[g]), quality)))
                        .collect()
                })
            })
            .collect();
        let prologue = (brotli(prologue.as_bytes(), &[], QUALITY.0), prologue.len());
        self.pending.push(Pending { arch: arch.to_string(), prologue, entries: index, lens, jobs });
    }

    /// Every architecture packed, in the order of `archs` (oldest first).
    fn finish(mut self, archs: &[String]) -> Vec<PackedArch> {
        let primary = self.primary.as_ref().map(|p| p.0.clone());
        archs
            .iter()
            .map(|arch| {
                let at = self.pending.iter().position(|p| &p.arch == arch).expect("every architecture was added");
                let mut p = self.pending.swap_remove(at);
                let mut streams: Vec<(usize, Vec<u8>)> = p
                    .jobs
                    .drain(..)
                    .flat_map(|j| j.join().unwrap_or_else(|_| fail("packing the PTX failed")))
                    .collect();
                streams.sort_by_key(|s| s.0);
                let (mut blob, prologue_len) = p.prologue;
                let prologue = (0, blob.len(), prologue_len);
                let groups = streams
                    .into_iter()
                    .zip(&p.lens)
                    .map(|((_, bytes), &len)| {
                        let start = blob.len();
                        blob.extend_from_slice(&bytes);
                        (start, blob.len(), len)
                    })
                    .collect();
                let base = (Some(arch) != primary.as_ref())
                    .then(|| archs.iter().position(|a| Some(a) == primary.as_ref()).expect("the primary is built"));
                PackedArch { arch: arch.clone(), blob, prologue, groups, base, entries: p.entries }
            })
            .collect()
    }
}

/// `text` as one brotli stream of `quality`, with `dict` (maybe empty) as its dictionary.
fn brotli(text: &[u8], dict: &[u8], quality: i32) -> Vec<u8> {
    let params =
        brotli::enc::BrotliEncoderParams { quality, lgwin: WINDOW, size_hint: text.len(), ..Default::default() };
    let mut out = Vec::new();
    let (mut input, mut output) = (vec![0u8; 1 << 16], vec![0u8; 1 << 16]);
    brotli::BrotliCompressCustomIoCustomDict(
        &mut brotli::IoReaderWrapper(&mut &text[..]),
        &mut brotli::IoWriterWrapper(&mut out),
        &mut input,
        &mut output,
        &params,
        brotli::enc::StandardAlloc::default(),
        &mut |_: &mut _, _: &mut _, _: _, _: &mut _| (),
        dict,
        std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "end of the PTX"),
    )
    .unwrap_or_else(|e| fail(&format!("packing the PTX: {e}")));
    out
}

/// The entry points in groups of [`GROUP`], each entry next to the one most like it: a greedy
/// chain from the first entry, each step to the most similar entry left (MinHash of their
/// lines, 64 hashes; ties to the earlier entry), cut into groups.
fn similar_groups(entries: &[(&str, &str)]) -> Vec<Vec<usize>> {
    const K: usize = 64;
    let signature = |text: &str| {
        let mut s = [u64::MAX; K];
        for line in text.as_bytes().split(|&c| c == b'\n') {
            let mut h = 0xcbf2_9ce4_8422_2325u64;
            for &b in line {
                h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
            }
            let h0 = h ^ (h >> 29);
            for (k, min) in s.iter_mut().enumerate() {
                let h = (h0 ^ (k as u64).wrapping_mul(0xff51_afd7_ed55_8ccd)).wrapping_mul(0xc4ce_b9fe_1a85_ec53);
                *min = (*min).min(h ^ (h >> 31));
            }
        }
        s
    };
    let sigs: Vec<[u64; K]> = entries.iter().map(|e| signature(e.1)).collect();
    let similarity = |i: usize, j: usize| sigs[i].iter().zip(&sigs[j]).filter(|(a, b)| a == b).count();
    let n = entries.len();
    let mut used = vec![false; n];
    let mut order = Vec::with_capacity(n);
    if n > 0 {
        order.push(0);
        used[0] = true;
    }
    while order.len() < n {
        let last = *order.last().expect("not empty");
        let next = (0..n)
            .filter(|&j| !used[j])
            .max_by_key(|&j| (similarity(last, j), std::cmp::Reverse(j)))
            .expect("one is left");
        used[next] = true;
        order.push(next);
    }
    order.chunks(GROUP).map(<[usize]>::to_vec).collect()
}

/// The index the host reads the packed PTX by (`ptx_index.rs`), naming `ptx-{arch}.bin`.
fn index(packed: &[PackedArch]) -> String {
    let mut index =
        format!("// Generated by rope-cuda's build.rs (`index`): the embedded PTX, per architecture ({PACKING}).\n");
    index += "pub(crate) static EMBEDDED: &[ArchPtx] = &[\n";
    for a in packed {
        let arch = &a.arch;
        let capability: u32 = arch[3..].parse().unwrap_or_else(|_| fail(&format!("{arch}: not sm_<number>")));
        index += &format!(
            "    ArchPtx {{\n        arch: {arch:?},\n        capability: {capability},\n        blob: include_bytes!(concat!(env!(\"OUT_DIR\"), \"/ptx-{arch}.bin\")),\n        prologue: {:?},\n        base: {:?},\n        groups: &{:?},\n        entries: &[\n",
            a.prologue, a.base, a.groups
        );
        for (name, g, offset, len) in &a.entries {
            index += &format!("            ({name:?}, {g}, {offset}, {len}),\n");
        }
        index += "        ],\n    },\n";
    }
    index += "];\n";
    index
}

/// Writes each architecture's blob to `ptx-{arch}.bin` and the index to `ptx_index.rs`.
fn write_packed(out: &Path, packed: &[PackedArch]) {
    for a in packed {
        write_bytes_if_changed(&out.join(format!("ptx-{}.bin", a.arch)), &a.blob);
    }
    write_if_changed(&out.join("ptx_index.rs"), &index(packed));
}

fn write_bytes_if_changed(path: &Path, bytes: &[u8]) {
    if std::fs::read(path).ok().as_deref() != Some(bytes) {
        std::fs::write(path, bytes).unwrap_or_else(|e| fail(&format!("writing {}: {e}", path.display())));
    }
}

/// Fails with the exact install command when the kernel toolchain or a component is missing.
fn check_toolchain(toolchain: &str) {
    let install = format!("rustup toolchain install {toolchain} --profile minimal -c {}", COMPONENTS.join(" -c "));
    let listed = Command::new("rustup")
        .args(["component", "list", "--installed", "--toolchain", toolchain])
        .env_remove("RUSTUP_TOOLCHAIN")
        .output();
    let listed = match listed {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).into_owned(),
        Ok(_) => fail(&format!(
            "the toolchain {toolchain}, which compiles the CUDA kernels, is not installed.\n\
             Install it with:\n    {install}"
        )),
        Err(e) => fail(&format!(
            "rustup is needed to build the CUDA kernels with {toolchain}, but running it failed ({e}).\n\
             Install rustup (https://rustup.rs), then:\n    {install}"
        )),
    };
    for component in COMPONENTS {
        if !listed.lines().any(|l| l == component || l.starts_with(&format!("{component}-"))) {
            fail(&format!(
                "the component {component} of toolchain {toolchain}, needed to build the CUDA kernels, \
                 is not installed.\nInstall it with:\n    rustup component add --toolchain {toolchain} {component}\n\
                 or everything at once with:\n    {install}"
            ));
        }
    }
}

/// Copies the kernel crate (manifest, build script, sources) from `from` into `to`, its
/// manifest made the root of a workspace of its own.
fn copy_crate(from: &Path, to: &Path) {
    let manifest = std::fs::read_to_string(from.join("Cargo.toml"))
        .unwrap_or_else(|e| fail(&format!("reading {}: {e}", from.join("Cargo.toml").display())));
    let _ = std::fs::remove_dir_all(to.join("src"));
    copy_dir(&from.join("src"), &to.join("src"));
    copy(&from.join("build.rs"), &to.join("build.rs"));
    let standalone = format!("{manifest}\n# Added by rope-cuda's build.rs: built on its own.\n[workspace]\n");
    write_if_changed(&to.join("Cargo.toml"), &standalone);
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap_or_else(|e| fail(&format!("creating {}: {e}", to.display())));
    let entries = std::fs::read_dir(from).unwrap_or_else(|e| fail(&format!("reading {}: {e}", from.display())));
    for entry in entries {
        let entry = entry.unwrap_or_else(|e| fail(&format!("reading {}: {e}", from.display())));
        let path = entry.path();
        if path.is_dir() {
            copy_dir(&path, &to.join(entry.file_name()));
        } else {
            copy(&path, &to.join(entry.file_name()));
        }
    }
}

fn write_if_changed(path: &Path, text: &str) {
    if std::fs::read_to_string(path).ok().as_deref() != Some(text) {
        std::fs::write(path, text).unwrap_or_else(|e| fail(&format!("writing {}: {e}", path.display())));
    }
}

fn copy(from: &Path, to: &Path) {
    std::fs::copy(from, to).unwrap_or_else(|e| fail(&format!("copying {} failed: {e}", from.display())));
}

fn fail(msg: &str) -> ! {
    eprintln!("\nerror: rope-cuda: {msg}\n");
    std::process::exit(1);
}
