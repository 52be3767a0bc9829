//! `yatt-node`: the daemon that hosts actors for a yatt cluster (see [`yatt::node`]).
//! A daemon with roles of your own is the same call with them added:
//! `yatt::node::main_with(|r| r.role::<MyReward>("my-reward"))`.

#[global_allocator]
static ALLOC: yatt::Allocator = yatt::Allocator;

fn main() -> std::process::ExitCode {
    yatt::node::main()
}
