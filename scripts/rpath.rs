// Shared by the build scripts of every package whose binaries or tests link libtorch.
//
// torch-sys (`links = "tch"`) exports the directory it linked libtorch from to its
// direct dependents as DEP_TCH_LIBTORCH_LIB. Baking it in as an rpath lets `yatt`,
// `yatt-node` and the test binaries run without LD_LIBRARY_PATH.
fn yatt_rpath() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if let Ok(dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}
