//! Placement and address allocation in O(1) per create (migration
//! `0005_shards_alloc.sql`): a sandbox goes to the named worker or the least
//! loaded one (a counter, not a count of its sandboxes); its address is the
//! lowest released one, or the next of the pool's hosts never handed out —
//! never a scan of the worker's sandboxes. A trigger on `sandboxes` records
//! every address a live sandbox holds and releases it when the sandbox is
//! destroyed or fails, so the primary key of `address_allocations` refuses
//! a second holder whichever replica placed it.
//!
//! A released address is handed out again only once the worker's gateway
//! has forgotten its last holder (the forget pushed: `pushed_generation`
//! caught up): until then the gateway would judge the new sandbox's
//! traffic under the old one's policy, and file it under the old one's
//! proposals. Without it the new sandbox is unknown there, and denied.

use std::net::IpAddr;
use std::str::FromStr;

use ipnet::IpNet;
use sqlx::{PgConnection, Row};

/// Released addresses looked at before walking the pool: those left from a
/// pool the worker no longer has are dropped on the way.
const FREE_TRIES: usize = 64;

/// The worker a sandbox goes to (the named one, or the least loaded but
/// those in `tried`), and its pool; its row locked until the transaction
/// ends, so placements on one worker allocate one at a time. Concurrent
/// unnamed placements skip the workers other placements hold, and so
/// spread.
pub async fn pick_worker(
    conn: &mut PgConnection,
    named: Option<&str>,
    tried: &[String],
) -> Result<Option<(String, String)>, sqlx::Error> {
    let row = if let Some(id) = named {
        sqlx::query("SELECT id, pool FROM workers WHERE id = $1 FOR UPDATE")
            .bind(id)
            .fetch_optional(&mut *conn)
            .await?
    } else {
        let mut row = None;
        for statement in [LEAST_LOADED_FREE, LEAST_LOADED] {
            row = sqlx::query(statement)
                .bind(tried)
                .fetch_optional(&mut *conn)
                .await?;
            if row.is_some() {
                break;
            }
        }
        row
    };
    row.map(|r| Ok((r.try_get("id")?, r.try_get("pool")?)))
        .transpose()
}

const LEAST_LOADED_FREE: &str = "SELECT w.id, w.pool FROM workers w LEFT JOIN address_cursors c ON c.worker = w.id WHERE w.id <> ALL($1) ORDER BY COALESCE(c.live, 0), w.id LIMIT 1 FOR UPDATE OF w SKIP LOCKED";
const LEAST_LOADED: &str = "SELECT w.id, w.pool FROM workers w LEFT JOIN address_cursors c ON c.worker = w.id WHERE w.id <> ALL($1) ORDER BY COALESCE(c.live, 0), w.id LIMIT 1 FOR UPDATE OF w";

/// A free address of `pool` for a sandbox on `worker` (whose row the caller
/// locked with [`pick_worker`]); `None` when the pool is used up or is not a
/// CIDR. The address is taken when the sandbox's row is saved with it.
pub async fn allocate(
    conn: &mut PgConnection,
    worker: &str,
    pool: &str,
) -> Result<Option<IpAddr>, sqlx::Error> {
    let Ok(net) = IpNet::from_str(pool) else {
        return Ok(None);
    };
    let next = cursor(conn, worker, pool).await?;
    for _ in 0..FREE_TRIES {
        let released: Option<String> = sqlx::query_scalar(
            "DELETE FROM address_free WHERE worker = $1 AND address = (SELECT f.address FROM address_free f WHERE f.worker = $1 AND NOT EXISTS (SELECT 1 FROM sandboxes s WHERE s.worker = $1 AND s.generation > s.pushed_generation AND s.state IN ('destroyed', 'failed') AND f.address = ANY (s.addresses::inet[])) ORDER BY f.address LIMIT 1) RETURNING host(address)",
        )
        .bind(worker)
        .fetch_optional(&mut *conn)
        .await?;
        let Some(released) = released else { break };
        if let Some(a) = released.parse().ok().filter(|a| is_host(&net, a)) {
            return Ok(Some(a));
        }
    }
    walk(conn, worker, &net, next).await
}

/// The worker's cursor, locked; a pool other than the one it walked starts
/// a new walk (and forgets the addresses released from the old one).
async fn cursor(conn: &mut PgConnection, worker: &str, pool: &str) -> Result<i64, sqlx::Error> {
    sqlx::query("INSERT INTO address_cursors (worker) VALUES ($1) ON CONFLICT DO NOTHING")
        .bind(worker)
        .execute(&mut *conn)
        .await?;
    let row = sqlx::query("SELECT pool, next FROM address_cursors WHERE worker = $1 FOR UPDATE")
        .bind(worker)
        .fetch_one(&mut *conn)
        .await?;
    let walked: Option<String> = row.try_get("pool")?;
    if walked.as_deref() == Some(pool) {
        return row.try_get("next");
    }
    sqlx::query("UPDATE address_cursors SET pool = $2, next = 0 WHERE worker = $1")
        .bind(worker)
        .bind(pool)
        .execute(&mut *conn)
        .await?;
    sqlx::query("DELETE FROM address_free WHERE worker = $1")
        .bind(worker)
        .execute(&mut *conn)
        .await?;
    Ok(0)
}

/// The pool's hosts from offset `next` on, skipping those a live sandbox
/// holds (placed before this table existed, or by an older replica) and
/// those an ended one held whose forget its gateway has not taken yet:
/// each is passed once, as the cursor moves past it.
async fn walk(
    conn: &mut PgConnection,
    worker: &str,
    net: &IpNet,
    mut next: i64,
) -> Result<Option<IpAddr>, sqlx::Error> {
    let found = loop {
        let Some(candidate) = nth_host(net, next) else {
            break None;
        };
        next += 1;
        let held: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM address_allocations WHERE worker = $1 AND address = $2::inet) OR EXISTS (SELECT 1 FROM sandboxes s WHERE s.worker = $1 AND s.generation > s.pushed_generation AND s.state IN ('destroyed', 'failed') AND $2::inet = ANY (s.addresses::inet[]))",
        )
        .bind(worker)
        .bind(candidate.to_string())
        .fetch_one(&mut *conn)
        .await?;
        if !held {
            break Some(candidate);
        }
    };
    sqlx::query("UPDATE address_cursors SET next = $2 WHERE worker = $1")
        .bind(worker)
        .bind(next)
        .execute(&mut *conn)
        .await?;
    Ok(found)
}

/// The `n`th host of the pool (its network and broadcast addresses excluded
/// where it has them), lowest first.
pub fn nth_host(net: &IpNet, n: i64) -> Option<IpAddr> {
    let n = usize::try_from(n).ok()?;
    net.hosts().nth(n)
}

/// Whether `a` is one of the pool's hosts.
fn is_host(net: &IpNet, a: &IpAddr) -> bool {
    net.contains(a)
        && match net {
            IpNet::V4(v4) if v4.prefix_len() < 31 => {
                *a != IpAddr::V4(v4.network()) && *a != IpAddr::V4(v4.broadcast())
            }
            _ => true,
        }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> IpNet {
        s.parse().expect("cidr")
    }

    #[test]
    fn hosts_lowest_first_without_network_and_broadcast() {
        let p = net("100.64.10.0/30");
        assert_eq!(nth_host(&p, 0), Some("100.64.10.1".parse().expect("ip")));
        assert_eq!(nth_host(&p, 1), Some("100.64.10.2".parse().expect("ip")));
        assert_eq!(nth_host(&p, 2), None);
        assert_eq!(nth_host(&p, -1), None);
        assert_eq!(
            nth_host(&net("100.64.1.2/32"), 0),
            Some("100.64.1.2".parse().expect("ip"))
        );
        // A large pool: the offset is not walked one by one.
        assert_eq!(
            nth_host(&net("100.64.0.0/10"), 65_535),
            Some("100.65.0.0".parse().expect("ip"))
        );
        assert!(is_host(&p, &"100.64.10.2".parse().expect("ip")));
        assert!(!is_host(&p, &"100.64.10.3".parse().expect("ip")));
        assert!(!is_host(&p, &"100.64.10.0".parse().expect("ip")));
        assert!(!is_host(&p, &"100.64.11.1".parse().expect("ip")));
    }
}
