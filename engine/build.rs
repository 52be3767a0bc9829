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

/// Builds `csrc/cuda_graph.cpp` (libtorch's CUDA graphs for the decode step) into a
/// shared object that the engine embeds and loads only when it records a graph
/// (`model/cuda_graph.rs`): executables keep linking no CUDA library, so they still start
/// where libtorch has no CUDA and do not map CUDA's libraries in every test process.
/// Built when the libtorch torch-sys links is a CUDA build and the CUDA runtime headers
/// are there: the PyPI wheel brings them (`nvidia/cu13/include` with the `nvidia-cuda-crt`
/// package, or `nvidia/cuda_runtime/include` for CUDA 12 wheels), so no CUDA toolkit is
/// needed; `YATT_CUDA_INCLUDE` names another folder. Otherwise the engine decodes eagerly.
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
    let root = lib
        .parent()
        .expect("libtorch lib dir has a parent")
        .to_path_buf();
    let site = root.parent().map(|p| p.to_path_buf()).unwrap_or_default();
    let candidates = [
        std::env::var("YATT_CUDA_INCLUDE")
            .map(std::path::PathBuf::from)
            .ok(),
        Some(site.join("nvidia/cu13/include")),
        Some(site.join("nvidia/cuda_runtime/include")),
        Some(std::path::PathBuf::from("/usr/local/cuda/include")),
    ];
    let Some(cuda_inc) = candidates
        .into_iter()
        .flatten()
        .find(|d| d.join("cuda_runtime_api.h").exists() && d.join("crt/host_config.h").exists())
    else {
        println!(
            "cargo:warning=libtorch has CUDA but the CUDA runtime headers (cuda_runtime_api.h, crt/) were not found (pip install nvidia-cuda-crt, or set YATT_CUDA_INCLUDE): building without CUDA graphs"
        );
        return;
    };
    let Some((cudart_dir, cudart)) = cudart(&site) else {
        println!(
            "cargo:warning=libtorch has CUDA but no libcudart.so.* beside it (nvidia/cu13/lib): building without CUDA graphs"
        );
        return;
    };
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let so = out.join("libyatt_cuda_graph.so");
    let compiler = cc::Build::new().cpp(true).get_compiler();
    let status = compiler
        .to_command()
        .args([
            "-shared",
            "-fPIC",
            "-O2",
            "-std=c++17",
            "-w",
            "-D_GLIBCXX_USE_CXX11_ABI=1",
        ])
        .arg("-I")
        .arg(root.join("include"))
        .arg("-I")
        .arg(root.join("include/torch/csrc/api/include"))
        .arg("-I")
        .arg(&cuda_inc)
        .arg("csrc/cuda_graph.cpp")
        .arg("-o")
        .arg(&so)
        .arg("-L")
        .arg(&lib)
        .args(["-ltorch_cuda", "-lc10_cuda", "-ltorch_cpu", "-lc10"])
        .arg("-L")
        .arg(&cudart_dir)
        .arg(format!("-l:{cudart}"))
        // Where these were at build time, should the process not have loaded them yet.
        .arg(format!(
            "-Wl,-rpath,{}:{}",
            lib.display(),
            cudart_dir.display()
        ))
        .status();
    match status {
        Ok(s) if s.success() => {
            println!("cargo:rustc-env=YATT_CUDA_GRAPH_SO={}", so.display());
            println!("cargo:rustc-cfg=yatt_cuda_graphs");
        }
        other => println!(
            "cargo:warning=compiling csrc/cuda_graph.cpp failed ({other:?}): building without CUDA graphs"
        ),
    }
}

/// The CUDA runtime a CUDA build of the torch wheel brings beside it: its folder and
/// file name (`nvidia/cu13/lib/libcudart.so.13`, or `nvidia/cuda_runtime/lib` for
/// CUDA 12 wheels).
fn cudart(site: &std::path::Path) -> Option<(std::path::PathBuf, String)> {
    ["nvidia/cu13/lib", "nvidia/cuda_runtime/lib"]
        .into_iter()
        .map(|d| site.join(d))
        .find_map(|d| {
            let name = std::fs::read_dir(&d)
                .ok()?
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("libcudart.so."))
                .min_by_key(|n| n.len())?;
            Some((d, name))
        })
}
