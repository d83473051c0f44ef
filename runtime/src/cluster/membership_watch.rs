//! The watch of a kind's members: a snapshot, then changes, and a new snapshot after every
//! etcd failure once it answers again. While etcd is unreachable nothing is sent, so the
//! caller keeps the membership it last saw.

use etcd_client::{Client, EventType, GetOptions, WatchOptions};
use tokio::sync::mpsc;

use super::etcd_connection::etcd_backoff;

/// A change in the members under a prefix. Keys are given without the prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MembershipEvent {
    /// Everything there is now (after a (re)connection): members not listed are gone.
    Snapshot(Vec<(String, String)>),
    /// A member appeared or changed its value.
    Put(String, String),
    /// A member's key was deleted (it withdrew or its lease lapsed).
    Delete(String),
}

/// Watches the members under `prefix`. The first event is a snapshot; after any etcd failure,
/// once etcd answers again, another snapshot follows. While etcd is unreachable nothing is
/// sent: the caller keeps what it last saw. Ends when the receiver is dropped.
pub fn watch_members(client: Client, prefix: String) -> mpsc::Receiver<MembershipEvent> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(watch_loop(client, prefix, tx));
    rx
}

async fn watch_loop(mut client: Client, prefix: String, tx: mpsc::Sender<MembershipEvent>) {
    let mut backoff = etcd_backoff();
    let strip = |k: &[u8]| String::from_utf8_lossy(&k[prefix.len().min(k.len())..]).into_owned();
    loop {
        if tx.is_closed() {
            return;
        }
        let listed = client.get(prefix.clone(), Some(GetOptions::new().with_prefix())).await;
        let (members, revision) = match listed {
            Ok(r) => {
                let members = r
                    .kvs()
                    .iter()
                    .map(|kv| (strip(kv.key()), String::from_utf8_lossy(kv.value()).into_owned()))
                    .collect::<Vec<_>>();
                (members, r.header().map_or(0, etcd_client::ResponseHeader::revision))
            }
            Err(e) => {
                tracing::debug!(%prefix, error = %e, "etcd: listing members failed; retrying");
                backoff.wait().await;
                continue;
            }
        };
        if tx.send(MembershipEvent::Snapshot(members)).await.is_err() {
            return;
        }
        let options = WatchOptions::new().with_prefix().with_start_revision(revision + 1);
        let mut stream = match client.watch(prefix.clone(), Some(options)).await {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(%prefix, error = %e, "etcd: watch failed; retrying");
                backoff.wait().await;
                continue;
            }
        };
        backoff.reset();
        loop {
            let msg = tokio::select! {
                msg = stream.message() => msg,
                () = tx.closed() => return,
            };
            let resp = match msg {
                Ok(Some(resp)) => resp,
                Ok(None) => break,
                Err(e) => {
                    tracing::debug!(%prefix, error = %e, "etcd: watch broke; listing again");
                    break;
                }
            };
            if resp.canceled() || resp.compact_revision() > 0 {
                break;
            }
            for ev in resp.events() {
                let Some(kv) = ev.kv() else { continue };
                let key = strip(kv.key());
                let event = match ev.event_type() {
                    EventType::Put => {
                        MembershipEvent::Put(key, String::from_utf8_lossy(kv.value()).into_owned())
                    }
                    EventType::Delete => MembershipEvent::Delete(key),
                };
                if tx.send(event).await.is_err() {
                    return;
                }
            }
        }
        backoff.wait().await;
    }
}
