//! `gangway admin inventory ...`: node admission. Node classes say which
//! nodes may register and what each may claim (CPUs, memory, GPUs and their
//! model, labels, topology); retired names never register again. Without a
//! class or a retired name, every node with an agent certificate registers
//! what it declares.
//!
//! Every edit is a read-modify-write of the whole inventory at the version
//! it read, retried when another admin's edit came first (as policy edits).

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use gangway_core::inventory::{NodeClass, NodeInventory, ANY_VALUE};
use gangway_proto::client::Client;
use gangway_proto::v1 as pb;
use serde_json::json;

use crate::output::{printable, Output};
use crate::policy::{gpus_arg, mem as mem_arg, POLICY_EDIT, POLICY_EDIT_ATTEMPTS_MAX};

#[derive(Subcommand)]
pub enum InventoryCmd {
    /// Show the node classes and retired nodes.
    Show,
    /// Create or change a node class (only the fields given change).
    Class {
        name: String,
        #[command(flatten)]
        args: ClassArgs,
        /// Remove the class: its nodes are refused and go down, unless
        /// another class admits them.
        #[arg(long, conflicts_with_all = ["nodes", "cpus", "mem", "gpus", "features", "topology"])]
        remove: bool,
    },
    /// Retire a node for good (a decommissioned host whose certificate may
    /// outlive it): it goes down and never registers again.
    Retire {
        /// A node name.
        name: String,
        /// Admit it again.
        #[arg(long)]
        undo: bool,
    },
    /// Replace the whole inventory with a JSON file (as `show --json` prints it).
    Import { file: std::path::PathBuf },
}

#[derive(Args)]
pub struct ClassArgs {
    /// Node names and hostlist patterns, comma-separated (gpu[001-064],cpu-*).
    #[arg(long, value_delimiter = ',')]
    nodes: Option<Vec<String>>,
    /// At most this many CPUs.
    #[arg(long)]
    cpus: Option<u32>,
    /// At most this much memory (MB, or with a K/M/G/T suffix).
    #[arg(long)]
    mem: Option<String>,
    /// At most this many GPUs: N (any model) or MODEL:N (h100-80gb:8).
    #[arg(long)]
    gpus: Option<String>,
    /// Labels the nodes may claim, comma-separated: KEY=VALUE, or KEY (any value).
    #[arg(long, value_delimiter = ',')]
    features: Option<Vec<String>>,
    /// The topology path the nodes' paths begin with (zone-a/row-3); empty: any.
    #[arg(long)]
    topology: Option<String>,
}

impl ClassArgs {
    fn apply(&self, c: &mut NodeClass) -> anyhow::Result<()> {
        if let Some(n) = &self.nodes {
            c.nodes = n.iter().filter(|x| !x.is_empty()).cloned().collect();
        }
        if let Some(n) = self.cpus {
            c.cpus = n;
        }
        if let Some(m) = mem_arg("--mem", &self.mem)? {
            c.mem_mb = m;
        }
        if let Some(g) = &self.gpus {
            (c.gpu_model, c.gpus) = gpus_arg(g)?;
        }
        if let Some(f) = &self.features {
            c.labels = f
                .iter()
                .filter(|x| !x.is_empty())
                .map(|x| x.split_once('=').map_or((x.clone(), ANY_VALUE.to_string()), |(k, v)| (k.into(), v.into())))
                .collect();
        }
        if let Some(t) = &self.topology {
            c.topology = t.split('/').filter(|x| !x.is_empty()).map(String::from).collect();
        }
        Ok(())
    }
}

async fn fetch(client: &Client) -> anyhow::Result<NodeInventory> {
    let resp = client.admin_get_node_inventory(pb::GetNodeInventoryRequest { stale: false }).await?.into_inner();
    serde_json::from_str(&resp.json).context("inventory: the controller sent an unreadable inventory")
}

async fn store(
    client: &Client,
    inventory: &NodeInventory,
    expected: Option<u64>,
) -> Result<pb::NodeInventory, tonic::Status> {
    let json = serde_json::to_string(inventory).expect("an inventory encodes");
    let req = pb::SetNodeInventoryRequest { json, expected_version: expected };
    Ok(client.admin_set_node_inventory(req.clone()).await?.into_inner())
}

/// Applies `edit` to the current inventory and stores it, retrying when
/// another edit came first.
async fn edit<F>(client: &Client, mut edit: F) -> anyhow::Result<pb::NodeInventory>
where
    F: FnMut(&mut NodeInventory) -> anyhow::Result<()>,
{
    let mut tries = POLICY_EDIT.tries();
    while tries.next().await {
        let mut inventory = fetch(client).await?;
        let version = inventory.version;
        edit(&mut inventory)?;
        match store(client, &inventory, Some(version)).await {
            Ok(v) => return Ok(v),
            Err(s) if s.code() == tonic::Code::Aborted => continue,
            Err(s) => return Err(s.into()),
        }
    }
    bail!("inventory: it kept changing under this edit ({POLICY_EDIT_ATTEMPTS_MAX} attempts); retry")
}

fn report(out: &Output, what: &str, stored: &pb::NodeInventory) {
    if out.json {
        println!("{}", json!({"result": what, "version": stored.version, "revoked": stored.revoked}));
        return;
    }
    println!("{what} (inventory version {})", stored.version);
    for n in &stored.revoked {
        println!("node {} is no longer admitted: it is down and its jobs were requeued", printable(n));
    }
}

pub async fn run(client: &Client, out: &Output, cmd: InventoryCmd) -> anyhow::Result<()> {
    match cmd {
        InventoryCmd::Show => {
            let inventory = fetch(client).await?;
            if out.json {
                println!("{}", serde_json::to_string_pretty(&inventory)?);
                return Ok(());
            }
            if !inventory.enforced() {
                println!("no node inventory: every node with an agent certificate registers what it declares");
                println!("(admit nodes with `gangway admin inventory class NAME --nodes ...`)");
                return Ok(());
            }
            println!(
                "{:<16} {:<28} {:>6} {:>10} {:>5} {:<14} {:<20} TOPOLOGY",
                "CLASS", "NODES", "CPUS", "MEM_MB", "GPUS", "GPU_MODEL", "FEATURES"
            );
            for (name, c) in &inventory.classes {
                let features: Vec<String> = c.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
                println!(
                    "{:<16} {:<28} {:>6} {:>10} {:>5} {:<14} {:<20} {}",
                    printable(name),
                    printable(&c.nodes.join(",")),
                    c.cpus,
                    c.mem_mb,
                    c.gpus,
                    if c.gpu_model.is_empty() { "any" } else { c.gpu_model.as_str() },
                    printable(&features.join(",")),
                    printable(&c.topology.join("/"))
                );
            }
            if !inventory.retired.is_empty() {
                let names: Vec<&str> = inventory.retired.iter().map(String::as_str).collect();
                println!("retired: {}", printable(&names.join(",")));
            }
            Ok(())
        }
        InventoryCmd::Class { name, args, remove } => {
            let stored = edit(client, |inv| {
                if remove {
                    if inv.classes.remove(&name).is_none() {
                        bail!("inventory: class '{name}' does not exist");
                    }
                    return Ok(());
                }
                let class = inv.classes.entry(name.clone()).or_default();
                args.apply(class)
            })
            .await?;
            report(out, &format!("class {name} {}", if remove { "removed" } else { "set" }), &stored);
            Ok(())
        }
        InventoryCmd::Retire { name, undo } => {
            let stored = edit(client, |inv| {
                if undo {
                    inv.retired.remove(&name);
                } else {
                    inv.retired.insert(name.clone());
                }
                Ok(())
            })
            .await?;
            report(out, &format!("node {name} {}", if undo { "no longer retired" } else { "retired" }), &stored);
            Ok(())
        }
        InventoryCmd::Import { file } => {
            let text = std::fs::read_to_string(&file).with_context(|| format!("{}", file.display()))?;
            let inventory: NodeInventory =
                serde_json::from_str(&text).with_context(|| format!("{}: not a node inventory", file.display()))?;
            inventory.validate().map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
            let stored = store(client, &inventory, None).await?;
            report(out, "inventory imported", &stored);
            Ok(())
        }
    }
}
