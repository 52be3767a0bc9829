//! `yatt-node` with the example's role: the same daemon (`init`, `cert`, `run`, its
//! flags and config, `/health`, `/metrics`), plus `length-format-reward` and
//! `repeat-filter` in its factory registry.

use custom_role::{LengthFormatReward, RepeatFilter, FILTER_NAME, ROLE_NAME};

fn main() -> std::process::ExitCode {
    yatt::node::main_with(|r| {
        r.role::<LengthFormatReward>(ROLE_NAME)
            .role::<RepeatFilter>(FILTER_NAME)
    })
}
