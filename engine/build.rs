fn main() {
    yatt_link_libtorch();
    onednn_shim();
    cuda_graph_shim();
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

/// Compiles `csrc/cuda_graph.cpp` (libtorch's CUDA graphs for the decode step) when the
/// libtorch torch-sys links is a CUDA build and the CUDA runtime headers are there: the
/// PyPI wheel brings them (`nvidia/cu13/include`, or `nvidia/cuda_runtime/include` for
/// CUDA 12 wheels), so no CUDA toolkit is needed. `YATT_CUDA_INCLUDE` names another
/// folder. Without them the engine builds without graphs and decodes eagerly.
fn cuda_graph_shim() {
    println!("cargo:rerun-if-changed=csrc/cuda_graph.cpp");
    println!("cargo:rerun-if-env-changed=YATT_CUDA_INCLUDE");
    let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        return;
    };
    let lib = std::path::PathBuf::from(lib);
    if !lib.join("libtorch_cuda.so").exists() {
        return;
    }
    let root = lib.parent().expect("libtorch lib dir has a parent").to_path_buf();
    let site = root.parent().map(|p| p.to_path_buf()).unwrap_or_default();
    let candidates = [
        std::env::var("YATT_CUDA_INCLUDE").map(std::path::PathBuf::from).ok(),
        Some(site.join("nvidia/cu13/include")),
        Some(site.join("nvidia/cuda_runtime/include")),
        Some(std::path::PathBuf::from("/usr/local/cuda/include")),
    ];
    let Some(cuda_inc) = candidates
        .into_iter()
        .flatten()
        .find(|d| d.join("cuda_runtime_api.h").exists())
    else {
        println!(
            "cargo:warning=libtorch has CUDA but no cuda_runtime_api.h was found (set YATT_CUDA_INCLUDE): building without CUDA graphs"
        );
        return;
    };
    let Some(cudart_dir) = yatt_cudart_dir(&lib) else {
        println!(
            "cargo:warning=libtorch has CUDA but no libcudart.so.* beside it (nvidia/cu13/lib): building without CUDA graphs"
        );
        return;
    };
    cc::Build::new()
        .cpp(true)
        .file("csrc/cuda_graph.cpp")
        .include(root.join("include"))
        .include(root.join("include/torch/csrc/api/include"))
        .include(&cuda_inc)
        .flag("-std=c++17")
        .flag("-w")
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .opt_level(2)
        .compile("yatt_cuda_graph");
    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=dylib=torch_cuda");
    println!("cargo:rustc-link-lib=dylib=c10_cuda");
    // The CUDA runtime calls inlined from the headers (events, errors, synchronize).
    let cudart = std::fs::read_dir(&cudart_dir)
        .expect("listed above")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("libcudart.so."))
        .min_by_key(|n| n.len())
        .expect("listed above");
    println!("cargo:rustc-link-search=native={}", cudart_dir.display());
    println!("cargo:rustc-link-lib=dylib:+verbatim={cudart}");
    println!("cargo:rustc-cfg=yatt_cuda_graphs");
}
