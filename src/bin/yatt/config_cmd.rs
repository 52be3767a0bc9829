//! `yatt config`: the generated references of the configs and the command line.

use clap::CommandFactory;

/// `yatt config …`.
#[derive(clap::Subcommand)]
pub enum ConfigCommand {
    /// Print every key of the job config and of the node config, with its type, default,
    /// allowed words and meaning, as Markdown (docs/reference/config.md is this output).
    Reference,
    /// Print the `--help` of every command of `yatt` and `yatt-node` as Markdown
    /// (docs/reference/cli.md is this output).
    CliReference,
}

pub fn run(cmd: ConfigCommand) -> anyhow::Result<()> {
    let page = match cmd {
        ConfigCommand::Reference => yatt::config_reference_page(),
        ConfigCommand::CliReference => {
            yatt::cli_reference_page(vec![crate::Cli::command(), yatt::node::cli_command()])
        }
    };
    print!("{page}");
    Ok(())
}
