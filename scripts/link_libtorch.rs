// Shared by the build scripts of every package whose binaries or tests link libtorch.
//
// - torch-sys (`links = "tch"`) exports the directory it linked libtorch from to its
//   direct dependents as DEP_TCH_LIBTORCH_LIB. Baking it in as an rpath lets `yatt`,
//   `yatt-node` and the test binaries run without LD_LIBRARY_PATH.
// - The executable exports yatt-engine's `mkl_serv_intel_cpu_true` (engine/src/mkl.rs):
//   libtorch's statically linked MKL calls it through the PLT to choose its kernels,
//   and the executable's definition comes first. `-u` pulls it out of the rlib.
fn yatt_link_libtorch() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if let Ok(dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
    if std::env::var("CARGO_CFG_TARGET_ARCH").as_deref() == Ok("x86_64")
        && std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux")
    {
        println!("cargo:rustc-link-arg=-Wl,-u,mkl_serv_intel_cpu_true");
        println!("cargo:rustc-link-arg=-Wl,--export-dynamic-symbol=mkl_serv_intel_cpu_true");
    }
}
