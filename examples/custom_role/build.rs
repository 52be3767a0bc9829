fn main() {
    yatt_rpath();
}
include!("../../scripts/rpath.rs");
