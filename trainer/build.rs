fn main() {
    yatt_link_libtorch();
}
include!("../scripts/link_libtorch.rs");
