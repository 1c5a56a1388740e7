//! `vmctl mcp`: Umbra's sessions as an MCP server on stdio, for agents and their frameworks
//! that speak the Model Context Protocol. The server is `umbra_mcp` (`docs/mcp.md`).

use std::path::PathBuf;

use clap::Args;
use rmcp::ServiceExt;
use umbra_mcp::server::{offered_folders, UmbraMcp};

#[derive(Args, Debug)]
pub struct McpArgs {
    /// A host folder sessions may share, `HOST_PATH[:NAME][:MODE]` (mode ro, rw, rwd or shadow;
    /// default shadow): `session_start` names it. Repeatable. No other folder is shared.
    #[arg(long = "folder", value_name = "SPEC")]
    folders: Vec<String>,
    /// umbrad's socket (default: `$UMBRA_SOCKET`, else the user's runtime directory).
    #[arg(long)]
    socket: Option<PathBuf>,
}

/// Serves MCP on stdin and stdout until the client goes.
pub async fn serve(args: McpArgs) -> anyhow::Result<()> {
    let folders = offered_folders(&args.folders).map_err(|e| anyhow::anyhow!("--folder {e}"))?;
    let server = UmbraMcp::new(args.socket, folders);
    let running = server.serve(rmcp::transport::stdio()).await?;
    running.waiting().await?;
    Ok(())
}
