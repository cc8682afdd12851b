//! `egress-gateway redirect`: the nftables ruleset that sends one sandbox
//! interface's traffic to the gateway — TCP to the transparent listener, DNS
//! to 8.8.8.8 and 1.1.1.1 to their DNS listeners — and drops every other UDP
//! from it (QUIC falls back to TCP). Each interface has its own table, so
//! sandboxes come and go independently.

/// Why rules could not be made or applied.
#[derive(Debug, thiserror::Error)]
pub enum RedirectError {
    #[error("--sandbox-iface {0:?}: expected 1 to 15 letters, digits, '-', '_' or '.'")]
    Iface(String),
    #[error("nft: {0}")]
    Nft(String),
}

/// The ports the rules redirect to.
#[derive(Clone, Copy, Debug)]
pub struct Ports {
    pub transparent: u16,
    pub dns: u16,
    pub dns_alt: u16,
}

/// The table holding one interface's rules.
pub fn table_name(iface: &str) -> Result<String, RedirectError> {
    let valid = !iface.is_empty()
        && iface.len() <= 15
        && iface
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
    if !valid {
        return Err(RedirectError::Iface(iface.to_owned()));
    }
    Ok(format!("egress_gw_{}", iface.replace(['-', '.'], "_")))
}

/// The ruleset, idempotent to apply: it replaces the interface's table whole.
pub fn ruleset(iface: &str, ports: Ports) -> Result<String, RedirectError> {
    let table = table_name(iface)?;
    let Ports {
        transparent,
        dns,
        dns_alt,
    } = ports;
    Ok(format!(
        r#"# egress-gateway: redirect sandbox interface {iface}
table inet {table}
delete table inet {table}
table inet {table} {{
    # Before NAT: only DNS to the reserved resolvers may leave as UDP.
    chain udp_guard {{
        type filter hook prerouting priority mangle; policy accept;
        iifname "{iface}" meta nfproto ipv4 udp dport 53 ip daddr {{ 8.8.8.8, 1.1.1.1 }} accept
        iifname "{iface}" meta l4proto udp counter drop
    }}
    chain to_gateway {{
        type nat hook prerouting priority dstnat; policy accept;
        iifname "{iface}" ip daddr 8.8.8.8 meta l4proto {{ tcp, udp }} th dport 53 redirect to :{dns}
        iifname "{iface}" ip daddr 1.1.1.1 meta l4proto {{ tcp, udp }} th dport 53 redirect to :{dns_alt}
        iifname "{iface}" meta l4proto tcp redirect to :{transparent}
    }}
}}
"#
    ))
}

/// Applies the ruleset with `nft -f -` (the same runner as machine egress).
pub fn apply(iface: &str, ports: Ports) -> Result<(), RedirectError> {
    nft()
        .apply(&ruleset(iface, ports)?)
        .map_err(|e| RedirectError::Nft(e.0))
}

/// Deletes the interface's table.
pub fn remove(iface: &str) -> Result<(), RedirectError> {
    let table = table_name(iface)?;
    nft()
        .apply(&format!("delete table inet {table}\n"))
        .map_err(|e| RedirectError::Nft(e.0))
}

fn nft() -> crate::machine::nft::Nft {
    crate::machine::nft::Nft::new(vec!["nft".into()])
}

#[cfg(test)]
mod tests {
    use super::*;

    const PORTS: Ports = Ports {
        transparent: 15001,
        dns: 15053,
        dns_alt: 15054,
    };

    #[test]
    fn ruleset_names_the_interface_and_ports() {
        let r = ruleset("tap-sb1", PORTS).expect("valid");
        assert!(r.contains("table inet egress_gw_tap_sb1 {"));
        assert!(r.contains(r#"iifname "tap-sb1" meta l4proto tcp redirect to :15001"#));
        assert!(
            r.contains("ip daddr 8.8.8.8 meta l4proto { tcp, udp } th dport 53 redirect to :15053")
        );
        assert!(
            r.contains("ip daddr 1.1.1.1 meta l4proto { tcp, udp } th dport 53 redirect to :15054")
        );
        assert!(r.contains(r#"iifname "tap-sb1" meta l4proto udp counter drop"#));
        // DNS redirects come before the catch-all TCP redirect.
        assert!(
            r.find("dport 53 redirect").expect("dns")
                < r.find("tcp redirect to :15001").expect("tcp")
        );
    }

    #[test]
    fn interface_names_are_checked() {
        for bad in [
            "",
            "a b",
            "x\"; flush ruleset",
            "averyveryverylongname",
            "eth0\n",
        ] {
            assert!(
                matches!(ruleset(bad, PORTS), Err(RedirectError::Iface(_))),
                "{bad:?}"
            );
        }
    }
}
