//! With the `rdma` feature, compiles `src/rdma/shim.c` and links libibverbs: dynamically by
//! default, statically (libibverbs.a, every provider and libnl, as `pkg-config --static`
//! lists them) when the target has `crt-static`; a static program registers the providers
//! named by `GRADSYNC_IB_STATIC_PROVIDERS` (default `rxe`) itself, since it cannot load them. Without the feature it does
//! nothing, so the default build needs no C compiler or RDMA library.
use std::env;
use std::process::Command;

fn run(c: &mut Command) {
    let ok = c
        .status()
        .unwrap_or_else(|e| panic!("{c:?}: {e}"))
        .success();
    assert!(
        ok,
        "{c:?} failed (the rdma feature needs gcc and libibverbs-dev)"
    );
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=GRADSYNC_IB_STATIC_PROVIDERS");
    if env::var_os("CARGO_FEATURE_RDMA").is_none() {
        return;
    }
    let out = env::var("OUT_DIR").expect("OUT_DIR");
    let src = "src/rdma/shim.c";
    println!("cargo:rerun-if-changed={src}");
    let crt_static = env::var("CARGO_CFG_TARGET_FEATURE")
        .unwrap_or_default()
        .split(',')
        .any(|f| f == "crt-static");
    let providers = env::var("GRADSYNC_IB_STATIC_PROVIDERS").unwrap_or_else(|_| "rxe".into());
    let cc = env::var("CC").unwrap_or_else(|_| "gcc".into());
    let mut c = Command::new(&cc);
    c.args(["-O2", "-fPIC", "-Wall", "-c", src, "-o"])
        .arg(format!("{out}/gs_shim.o"));
    if crt_static {
        c.arg(format!("-DRDMA_STATIC_PROVIDERS={providers}"));
    }
    run(&mut c);
    run(Command::new("ar")
        .arg("crs")
        .arg(format!("{out}/libgs_shim.a"))
        .arg(format!("{out}/gs_shim.o")));
    println!("cargo:rustc-link-search=native={out}");
    println!("cargo:rustc-link-lib=static=gs_shim");
    if crt_static {
        let libs = Command::new("pkg-config")
            .args(["--static", "--libs", "libibverbs"])
            .output()
            .expect("pkg-config (the static rdma build needs it)");
        let libs = String::from_utf8_lossy(&libs.stdout).into_owned();
        // Linked by the final program (not bundled), where every crate's binary sees them;
        // the linker resolves the cycles between libibverbs and its providers.
        let mut seen = std::collections::HashSet::new();
        for l in libs.split_whitespace().filter_map(|a| a.strip_prefix("-l")) {
            if l == "pthread" || !seen.insert(l) {
                continue;
            }
            println!("cargo:rustc-link-lib=static:-bundle,+verbatim=lib{l}.a");
        }
    } else {
        println!("cargo:rustc-link-lib=dylib=ibverbs");
    }
}
