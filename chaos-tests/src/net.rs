//! Test hosts: one Linux network namespace per host, each with its own address
//! on a bridge the test creates, and iptables partitions between them.
//!
//! ```text
//!   root namespace (the test, its clients)  10.88.S.254
//!        │ bridge gwbrID
//!   ├── veth ── netns gwID-h1  10.88.S.1   (a controller or an agent)
//!   ├── veth ── netns gwID-h2  10.88.S.2
//!   └── ...
//! ```
//!
//! Everything created here is removed on drop, also when a test fails: the
//! namespaces (which takes their veth ends and iptables rules with them) and
//! the bridge.

use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{bail, Context};

/// Hosts in one test network: the /24 leaves 1..=253 for hosts.
pub const HOSTS_MAX: usize = 32;

/// Distinguishes networks made by one test process (their names and subnets).
static NEXT_NET: AtomicU32 = AtomicU32::new(0);

/// Runs `ip`/`iptables` style commands; an error names the command and its stderr.
pub fn sh(program: &str, args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new(program).args(args).output().with_context(|| format!("running {program}"))?;
    if !out.status.success() {
        bail!("{program} {} failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

/// One test host.
#[derive(Debug, Clone)]
pub struct Host {
    /// The network namespace name.
    pub netns: String,
    /// Its address on the test bridge.
    pub ip: String,
    /// The root-namespace end of its veth pair.
    outer: String,
}

pub struct TestNet {
    bridge: String,
    /// Short id in every name this network creates.
    id: String,
    /// The third octet of the network's 10.88.S.0/24.
    subnet: usize,
    pub hosts: Vec<Host>,
}

/// A network of `n` hosts can be made: 1 to HOSTS_MAX (each host's
/// address is one of the /24's).
fn check_hosts(n: usize) -> anyhow::Result<()> {
    if n == 0 || n > HOSTS_MAX {
        bail!("hosts: between 1 and {HOSTS_MAX}, got {n}");
    }
    Ok(())
}

impl TestNet {
    /// Creates `n` hosts on a new bridge. Needs root, `ip` and `iptables`.
    pub fn create(n: usize) -> anyhow::Result<TestNet> {
        check_hosts(n)?;
        if !nix::unistd::geteuid().is_root() {
            bail!("chaos tests need root (network namespaces, iptables)");
        }
        let seq = NEXT_NET.fetch_add(1, Ordering::Relaxed);
        // Short names: interface names are limited to 15 bytes.
        let id = format!("{:x}", (std::process::id() % 0x1000) * 16 + seq % 16);
        let subnet = 10 + (std::process::id() as usize * 7 + seq as usize) % 240;
        let bridge = format!("gwbr{id}");
        let mut net = TestNet { bridge: bridge.clone(), id, subnet, hosts: Vec::new() };
        sh("ip", &["link", "add", &bridge, "type", "bridge"])?;
        sh("ip", &["addr", "add", &format!("10.88.{subnet}.254/24"), "dev", &bridge])?;
        sh("ip", &["link", "set", &bridge, "up"])?;
        for _ in 0..n {
            net.add_host()?;
        }
        Ok(net)
    }

    /// Adds one more host to the network; returns its index.
    pub fn add_host(&mut self) -> anyhow::Result<usize> {
        let h = self.hosts.len() + 1;
        check_hosts(h)?;
        let (id, subnet) = (self.id.clone(), self.subnet);
        let netns = format!("gw{id}-h{h}");
        let (outer, inner) = (format!("gw{id}v{h}"), format!("gw{id}p{h}"));
        let ip = format!("10.88.{subnet}.{h}");
        sh("ip", &["netns", "add", &netns])?;
        self.hosts.push(Host { netns: netns.clone(), ip: ip.clone(), outer: outer.clone() });
        sh("ip", &["link", "add", &outer, "type", "veth", "peer", "name", &inner])?;
        sh("ip", &["link", "set", &inner, "netns", &netns])?;
        sh("ip", &["link", "set", &outer, "master", &self.bridge, "up"])?;
        self.exec(h - 1, &["ip", "addr", "add", &format!("{ip}/24"), "dev", &inner])?;
        self.exec(h - 1, &["ip", "link", "set", &inner, "up"])?;
        self.exec(h - 1, &["ip", "link", "set", "lo", "up"])?;
        Ok(h - 1)
    }

    /// Runs a command inside host `h`'s namespace and waits for it.
    pub fn exec(&self, h: usize, argv: &[&str]) -> anyhow::Result<()> {
        let mut args = vec!["netns", "exec", self.hosts[h].netns.as_str()];
        args.extend_from_slice(argv);
        sh("ip", &args)
    }

    /// Drops all traffic between the hosts in `a` and those in `b`, both ways.
    pub fn partition(&self, a: &[usize], b: &[usize]) -> anyhow::Result<()> {
        for &x in a {
            for &y in b {
                self.drop_between(x, y)?;
                self.drop_between(y, x)?;
            }
        }
        Ok(())
    }

    /// Host `x` stops hearing from host `y` (one-way loss).
    pub fn drop_between(&self, x: usize, y: usize) -> anyhow::Result<()> {
        self.exec(x, &["iptables", "-A", "INPUT", "-s", &self.hosts[y].ip, "-j", "DROP"])
    }

    /// Host `h` drops this fraction of the packets it receives, at random
    /// (iptables' statistic match: this kernel has no netem).
    pub fn lossy(&self, h: usize, probability: f64) -> anyhow::Result<()> {
        let p = format!("{:.2}", probability.clamp(0.0, 1.0));
        self.exec(
            h,
            &["iptables", "-A", "INPUT", "-m", "statistic", "--mode", "random", "--probability", &p, "-j", "DROP"],
        )
    }

    /// Cuts host `h` off from every other host and from the test's clients.
    pub fn isolate(&self, h: usize) -> anyhow::Result<()> {
        self.exec(h, &["iptables", "-A", "INPUT", "-s", "10.88.0.0/16", "-j", "DROP"])?;
        self.exec(h, &["iptables", "-A", "OUTPUT", "-d", "10.88.0.0/16", "-j", "DROP"])
    }

    /// Removes every rule: the network is whole again.
    pub fn heal(&self) -> anyhow::Result<()> {
        for h in 0..self.hosts.len() {
            self.exec(h, &["iptables", "-F"])?;
        }
        Ok(())
    }
}

impl Drop for TestNet {
    fn drop(&mut self) {
        for h in &self.hosts {
            let _ = sh("ip", &["netns", "del", &h.netns]);
            // Gone with the namespace, unless a straggling process still holds it.
            let _ = sh("ip", &["link", "del", &h.outer]);
        }
        let _ = sh("ip", &["link", "del", &self.bridge]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Networks of 1 to HOSTS_MAX hosts; one more is refused before anything is made.
    #[test]
    fn networks_have_at_most_hosts_max_hosts() {
        assert!(check_hosts(1).is_ok() && check_hosts(HOSTS_MAX).is_ok());
        let err = TestNet::create(HOSTS_MAX + 1).err().expect("one host past HOSTS_MAX").to_string();
        assert_eq!(err, format!("hosts: between 1 and {HOSTS_MAX}, got {}", HOSTS_MAX + 1));
        assert!(check_hosts(0).is_err());
    }
}
