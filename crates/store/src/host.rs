//! Which host is this, and how other hosts reach it.
//!
//! Two questions recur wherever a job spans hosts:
//!
//! - **Is this endpoint this host?** A c10d rendezvous endpoint is hosted by
//!   the node it names. [`is_this_host`] says yes for `localhost`, any loopback
//!   address, this host's hostname or fully qualified name, any address on this
//!   host's interfaces (`getifaddrs`), and any name that resolves to one of
//!   those. IPv4 and IPv6, bracketed or not. torchrun accepts the first four and
//!   the addresses its own hostname resolves to; it misses an interface address
//!   its hostname does not resolve to (a second NIC, a name mapped to
//!   `127.0.1.1`) and an alias of this host in `/etc/hosts` or DNS.
//! - **What do we tell the others?** [`advertised_addr`] is the address another
//!   host can reach this one at. It is never a loopback name or address while
//!   this host has another: the hostname when it resolves here to an address on
//!   one of this host's interfaces (the others most likely resolve it the same
//!   way), else the address the default route leaves from, else the first
//!   non-loopback interface address.
//!
//! Resolving a name may block for as long as the resolver takes (a DNS server
//! that does not answer): call these at set-up, not on a hot path.

use std::ffi::{CStr, CString};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs, UdpSocket};

/// The name of this host (`gethostname`, as Python's `socket.gethostname()`).
pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for writes of its length; gethostname writes
    // at most that many bytes.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if r != 0 {
        return "localhost".into();
    }
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// This host's canonical name (`getaddrinfo` with `AI_CANONNAME`), or its
/// hostname when it has none.
pub fn fqdn() -> String {
    let name = hostname();
    canonical_name(&name).unwrap_or(name)
}

fn canonical_name(name: &str) -> Option<String> {
    let c = CString::new(name).ok()?;
    // SAFETY: an all-zero addrinfo is a valid "no hints" value.
    let mut hints: libc::addrinfo = unsafe { std::mem::zeroed() };
    hints.ai_flags = libc::AI_CANONNAME;
    hints.ai_socktype = libc::SOCK_STREAM;
    let mut res: *mut libc::addrinfo = std::ptr::null_mut();
    // SAFETY: `c` is NUL-terminated, `hints` and `res` are valid for the call.
    let r = unsafe { libc::getaddrinfo(c.as_ptr(), std::ptr::null(), &hints, &mut res) };
    if r != 0 || res.is_null() {
        return None;
    }
    // SAFETY: getaddrinfo succeeded, so `res` points at a list it allocated;
    // the first entry carries the canonical name (NUL-terminated or null).
    let out = unsafe {
        let cn = (*res).ai_canonname;
        let out = (!cn.is_null()).then(|| CStr::from_ptr(cn).to_string_lossy().into_owned());
        libc::freeaddrinfo(res);
        out
    };
    out.filter(|s| !s.is_empty())
}

/// The addresses on this host's interfaces (`getifaddrs`), loopback included.
pub fn interface_addrs() -> Vec<IpAddr> {
    let mut out = Vec::new();
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: `list` is valid for the call to write the head of its list.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return out;
    }
    let mut cur = list;
    while !cur.is_null() {
        // SAFETY: `cur` is an entry of the list getifaddrs returned, not yet
        // freed; `ifa_addr` is null or points at a sockaddr of the family it
        // names, sized for that family.
        unsafe {
            let sa = (*cur).ifa_addr;
            if !sa.is_null() {
                match i32::from((*sa).sa_family) {
                    libc::AF_INET => {
                        let sin = &*(sa as *const libc::sockaddr_in);
                        out.push(IpAddr::V4(Ipv4Addr::from(u32::from_be(
                            sin.sin_addr.s_addr,
                        ))));
                    }
                    libc::AF_INET6 => {
                        let sin6 = &*(sa as *const libc::sockaddr_in6);
                        out.push(IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)));
                    }
                    _ => {}
                }
            }
            cur = (*cur).ifa_next;
        }
    }
    // SAFETY: `list` came from a successful getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(list) };
    out
}

/// `host` without the brackets of an IPv6 literal (`[::1]` is `::1`).
pub fn unbracket(host: &str) -> &str {
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

/// The addresses `host` resolves to (none if it does not).
pub fn resolve(host: &str) -> Vec<IpAddr> {
    let host = unbracket(host);
    if let Ok(ip) = host.parse::<IpAddr>() {
        return vec![ip];
    }
    (host, 0)
        .to_socket_addrs()
        .map(|a| a.map(|a| a.ip()).collect())
        .unwrap_or_default()
}

/// Whether `host` names this host: see the module docs. An empty host is
/// this host (an endpoint of only a port).
pub fn is_this_host(host: &str) -> bool {
    let host = unbracket(host.trim());
    if host.is_empty() || host.eq_ignore_ascii_case("localhost") {
        return true;
    }
    let names_us = |n: &str| n.eq_ignore_ascii_case(host);
    if names_us(&hostname()) || names_us(&fqdn()) {
        return true;
    }
    let ours = interface_addrs();
    resolve(host)
        .iter()
        .any(|ip| is_loopback(ip) || ours.contains(&unmapped(*ip)))
}

/// Whether `ip` is a loopback address (IPv4-mapped ones included).
pub fn is_loopback(ip: &IpAddr) -> bool {
    unmapped(*ip).is_loopback()
}

/// Whether `host` is `localhost` or a loopback literal: an address that means
/// a different host on every host.
pub fn is_loopback_name(host: &str) -> bool {
    let host = unbracket(host.trim());
    host.eq_ignore_ascii_case("localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| is_loopback(&ip))
}

fn unmapped(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    }
}

/// The address other hosts reach this one at: see the module docs. Falls back
/// to the hostname on a host with no address but loopback (it has no other
/// host to talk to).
pub fn advertised_addr() -> String {
    let name = hostname();
    let ours = interface_addrs();
    let usable = |ip: &IpAddr| !is_loopback(ip) && !is_link_local(ip);
    if resolve(&name)
        .iter()
        .any(|ip| usable(ip) && ours.contains(&unmapped(*ip)))
    {
        return name;
    }
    let routed = [
        SocketAddr::from((Ipv4Addr::new(192, 0, 2, 1), 9)),
        SocketAddr::from((Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1), 9)),
    ]
    .into_iter()
    .find_map(source_addr_towards)
    .filter(usable);
    let first = || {
        let v4 = ours.iter().find(|ip| ip.is_ipv4() && usable(ip));
        v4.or_else(|| ours.iter().find(|ip| usable(ip))).copied()
    };
    match routed.or_else(first) {
        Some(ip) => ip.to_string(),
        None => name,
    }
}

/// The source address this host would use to send to `to` (a UDP "connect"
/// sends nothing): `None` without a route.
pub fn source_addr_towards(to: SocketAddr) -> Option<IpAddr> {
    let bind: SocketAddr = match to {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let s = UdpSocket::bind(bind).ok()?;
    s.connect(to).ok()?;
    Some(s.local_addr().ok()?.ip())
}

fn is_link_local(ip: &IpAddr) -> bool {
    match unmapped(*ip) {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_names_and_literals_are_this_host() {
        for h in [
            "",
            "localhost",
            "LOCALHOST",
            "127.0.0.1",
            "127.0.1.1",
            "::1",
            "[::1]",
        ] {
            assert!(is_this_host(h), "{h:?}");
        }
        assert!(is_this_host("::ffff:127.0.0.1"));
    }

    #[test]
    fn this_hosts_names_and_interface_addresses_are_this_host() {
        assert!(is_this_host(&hostname()));
        assert!(is_this_host(&hostname().to_uppercase()));
        assert!(is_this_host(&fqdn()));
        for ip in interface_addrs() {
            assert!(is_this_host(&ip.to_string()), "{ip}");
            if ip.is_ipv6() {
                assert!(is_this_host(&format!("[{ip}]")), "[{ip}]");
            }
        }
        assert!(is_this_host(&advertised_addr()));
    }

    #[test]
    fn other_addresses_and_unknown_names_are_not_this_host() {
        // TEST-NET-1 and the documentation prefix: never on an interface here.
        for h in [
            "192.0.2.77",
            "[2001:db8::77]",
            "2001:db8::77",
            "no-such-host.invalid",
        ] {
            assert!(!is_this_host(h), "{h:?}");
        }
    }

    #[test]
    fn the_advertised_address_is_never_loopback_on_a_host_with_another() {
        let has_other = interface_addrs()
            .iter()
            .any(|ip| !is_loopback(ip) && !is_link_local(ip));
        let a = advertised_addr();
        if has_other {
            assert!(!is_loopback_name(&a), "{a}");
            assert!(
                resolve(&a).iter().all(|ip| !is_loopback(ip)),
                "{a} resolves to loopback"
            );
        }
    }

    #[test]
    fn brackets_are_taken_off_v6_literals_only() {
        assert_eq!(unbracket("[::1]"), "::1");
        assert_eq!(unbracket("::1"), "::1");
        assert_eq!(unbracket("node1"), "node1");
        assert!(is_loopback_name("[::1]"));
        assert!(is_loopback_name("127.3.4.5"));
        assert!(!is_loopback_name("node1"));
    }
}
