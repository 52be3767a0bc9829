fn main() {
    yatt_rpath();
    onednn_shim();
}
include!("../scripts/rpath.rs");

/// Compiles the small C++ shim over libtorch's oneDNN linear operators
/// (`csrc/onednn_linear.cpp`) against the headers of the libtorch torch-sys links.
fn onednn_shim() {
    println!("cargo:rerun-if-changed=csrc/onednn_linear.cpp");
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
        .include(root.join("include"))
        .include(root.join("include/torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag("-w")
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .opt_level(2)
        .compile("yatt_onednn");
    println!("cargo:rustc-link-search=native={lib}");
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
    println!("cargo:rustc-link-lib=dylib=c10");
    println!("cargo:rustc-cfg=yatt_onednn");
}
