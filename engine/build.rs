fn main() {
    yatt_link_libtorch();
    onednn_shim();
}
include!("../scripts/link_libtorch.rs");

/// Compiles the small C++ shim over libtorch's oneDNN linear operators
/// (`csrc/onednn_linear.cpp`) and the fused CPU decode step (`csrc/decode_step.cpp`)
/// against the headers of the libtorch torch-sys links.
fn onednn_shim() {
    println!("cargo:rerun-if-changed=csrc/onednn_linear.cpp");
    println!("cargo:rerun-if-changed=csrc/decode_step.cpp");
    println!("cargo:rerun-if-changed=csrc/fused_adamw.cpp");
    println!("cargo:rerun-if-changed=csrc/shim.h");
    let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        println!(
            "cargo:warning=DEP_TCH_LIBTORCH_LIB unset: building without the oneDNN linear shim"
        );
        return;
    };
    let root = std::path::Path::new(&lib)
        .parent()
        .expect("libtorch lib dir has a parent")
        .to_path_buf();
    cc::Build::new()
        .cpp(true)
        .file("csrc/onednn_linear.cpp")
        .file("csrc/decode_step.cpp")
        .file("csrc/fused_adamw.cpp")
        .include(root.join("include"))
        .include(root.join("include/torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag("-w")
        // at::parallel_for's OpenMP regions and `omp simd` loops in decode_step.cpp; the
        // runtime is libtorch's own libgomp, linked below.
        .flag("-fopenmp")
        // No errno or FP-exception bookkeeping, so math in the loops vectorizes; results of
        // ordinary arithmetic are unchanged (no -ffast-math reassociation).
        .flag("-fno-math-errno")
        .flag("-fno-trapping-math")
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .opt_level(3)
        .compile("yatt_onednn");
    println!("cargo:rustc-link-search=native={lib}");
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
    println!("cargo:rustc-link-lib=dylib=c10");
    // The OpenMP runtime libtorch itself loads (the PyPI wheel ships `libgomp.so.1`, some
    // builds a hashed name); the compiler's own only when libtorch brings none.
    let gomp = std::fs::read_dir(&lib).ok().and_then(|rd| {
        let mut names: Vec<String> = rd
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("libgomp") && n.contains(".so"))
            .collect();
        names.sort();
        names.into_iter().next()
    });
    match gomp {
        Some(name) => println!("cargo:rustc-link-lib=dylib:+verbatim={name}"),
        None => println!("cargo:rustc-link-lib=dylib=gomp"),
    }
    println!("cargo:rustc-cfg=yatt_onednn");
}
