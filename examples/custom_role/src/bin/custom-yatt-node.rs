//! `yatt-node` with the example's role: the same daemon (`init`, `cert`, `run`, its
//! flags and config, `/health`, `/metrics`), plus `length-format-reward` and
//! `repeat-filter` in its factory registry.

use custom_role::{LengthFormatReward, RepeatFilter, FILTER_NAME, ROLE_NAME};

// The allocator the stock daemon uses (why: `yatt::Allocator`'s docs).
#[global_allocator]
static ALLOC: yatt::Allocator = yatt::Allocator;

fn main() -> std::process::ExitCode {
    yatt::node::main_with(|r| {
        r.role::<LengthFormatReward>(ROLE_NAME)
            .role::<RepeatFilter>(FILTER_NAME)
    })
}
