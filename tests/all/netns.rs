//! Network namespaces for the chaos hosts (issue 38, item 17): each host
//! runs in a namespace of its own, joined to the test's namespace by a veth
//! pair, and reaches the database and the sink at one service address that
//! the test's namespace holds (on `lo`). Cutting a host's link
//! (`ip link set … down`) partitions it from the database, the sink and the
//! test alike; restoring it lets its held-up packets through.
//!
//! Needs root (CI runs as root) and a kernel that allows namespaces:
//! [`Net::create`] says which is missing. It never skips quietly.

use std::net::Ipv4Addr;
use std::process::Command;

use anyhow::{Context, Result, bail};

/// The namespaces, links and service address of one chaos run.
pub struct Net {
    tag: u32,
    hosts: usize,
    /// Made so far: removed on drop, in reverse.
    made_hosts: usize,
    service_added: bool,
}

fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip").args(args).output().context("running `ip` (install iproute2)")?;
    if !out.status.success() {
        bail!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

impl Net {
    /// Namespaces for `hosts` hosts. An error names what refused them
    /// (not root, no namespace support, no `ip`).
    pub fn create(hosts: usize) -> Result<Net> {
        let euid = Command::new("id").arg("-u").output().context("running id")?;
        if !euid.stdout.starts_with(b"0\n") {
            bail!(
                "the partition fault needs root to make network namespaces; run as root, or set \
                 LEASEHOLD_CHAOS_PARTITIONS=0 to leave the fault out (the run then proves less)"
            );
        }
        // Distinct per process, so two runs on one machine do not collide.
        let tag = std::process::id() % 240 + 1;
        let mut net = Net { tag, hosts, made_hosts: 0, service_added: false };
        // A leftover from a killed run with the same tag.
        for h in 0..hosts {
            let _ = ip(&["netns", "del", &net.ns(h)]);
            let _ = ip(&["link", "del", &net.veth(h)]);
        }
        let _ = ip(&["addr", "del", &format!("{}/32", net.service()), "dev", "lo"]);
        ip(&["addr", "add", &format!("{}/32", net.service()), "dev", "lo"])
            .context("adding the service address (the kernel refused: namespaces unsupported here?)")?;
        net.service_added = true;
        for h in 0..hosts {
            let (ns, veth, peer) = (net.ns(h), net.veth(h), format!("lhp{tag}p{h}"));
            ip(&["netns", "add", &ns]).context("making a network namespace (the kernel refused it)")?;
            net.made_hosts = h + 1;
            ip(&["link", "add", &veth, "type", "veth", "peer", "name", &peer, "netns", &ns])?;
            ip(&["addr", "add", &format!("{}/30", net.gateway(h)), "dev", &veth])?;
            ip(&["link", "set", &veth, "up"])?;
            ip(&["-n", &ns, "addr", "add", &format!("{}/30", net.host(h)), "dev", &peer])?;
            ip(&["-n", &ns, "link", "set", &peer, "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            ip(&["-n", &ns, "route", "add", "default", "via", &net.gateway(h).to_string()])?;
        }
        Ok(net)
    }

    /// The address the database and the sink listen on, reachable from
    /// every host's namespace.
    pub fn service(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 231, self.tag as u8, 1)
    }

    /// Host `h`'s address (its API listens there).
    pub fn host(&self, h: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, 232, self.tag as u8, (4 * h + 2) as u8)
    }

    fn gateway(&self, h: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, 232, self.tag as u8, (4 * h + 1) as u8)
    }

    fn ns(&self, h: usize) -> String {
        format!("lhp{}n{h}", self.tag)
    }

    fn veth(&self, h: usize) -> String {
        format!("lhp{}v{h}", self.tag)
    }

    /// The command prefix that runs a program in host `h`'s namespace
    /// (`ip netns exec` execs it: the child's pid is the program's).
    pub fn exec_prefix(&self, h: usize) -> Vec<String> {
        vec!["ip".into(), "netns".into(), "exec".into(), self.ns(h)]
    }

    /// Cuts host `h` off: nothing goes in or out until [`Net::restore`].
    pub fn cut(&self, h: usize) -> Result<()> {
        ip(&["link", "set", &self.veth(h), "down"])
    }

    pub fn restore(&self, h: usize) -> Result<()> {
        ip(&["link", "set", &self.veth(h), "up"])
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for h in (0..self.made_hosts.min(self.hosts)).rev() {
            // Deleting the namespace deletes its end of the pair, and so
            // the pair.
            let _ = ip(&["netns", "del", &self.ns(h)]);
            let _ = ip(&["link", "del", &self.veth(h)]);
        }
        if self.service_added {
            let _ = ip(&["addr", "del", &format!("{}/32", self.service()), "dev", "lo"]);
        }
    }
}
