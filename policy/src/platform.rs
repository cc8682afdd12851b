//! The built-in platform denies: destinations no sandbox may reach, whatever
//! its policy says. The gateway adds its own addresses and the configured
//! `policy.platform_deny` list.

use crate::dest::Destination;

/// Loopback, link-local and cloud metadata, private and shared ranges,
/// "this network", multicast and reserved space, and the IPv6 forms of
/// IPv4 tunnels.
pub const DEFAULT_PLATFORM_DENY_CIDRS: &[&str] = &[
    "127.0.0.0/8",
    "::1/128",
    "::/128",
    "169.254.0.0/16",
    "fe80::/10",
    "fd00:ec2::254/128",
    "168.63.129.16/32",
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "100.64.0.0/10",
    "fc00::/7",
    "0.0.0.0/8",
    "224.0.0.0/4",
    "ff00::/8",
    "240.0.0.0/4",
    // IPv6 forms that carry an IPv4 address to a tunnel the host may have
    // (6to4, Teredo, IPv4-compatible): whatever IPv4 address they embed,
    // the platform denies would not see it.
    "2002::/16",
    "2001::/32",
    "::/96",
    // The local-use NAT64 prefix (RFC 8215): a translator the host has
    // maps it to any IPv4 address, private ones included.
    "64:ff9b:1::/48",
    // The IPv4-translated form of stateless translation (RFC 2765,
    // `::ffff:0:a.b.c.d`), for a translator configured with it.
    "::ffff:0:0:0/96",
];

/// The built-in list as destinations.
pub fn default_denies() -> Vec<Destination> {
    DEFAULT_PLATFORM_DENY_CIDRS
        .iter()
        // The list above is a constant checked by `default_list_parses`.
        .filter_map(|c| Destination::parse(crate::Kind::Cidr, c).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_list_parses() {
        assert_eq!(default_denies().len(), DEFAULT_PLATFORM_DENY_CIDRS.len());
    }
}
