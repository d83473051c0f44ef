//! Executor discovery through etcd (DESIGN.md §7): watch `/ferry/<cluster>/executors/`, open
//! a session to each executor that registers, and close it when its key goes away (it withdrew
//! on drain, or its lease lapsed because it stopped answering).
//!
//! The set of registered executors is the wanted state; a reconcile pass every second (and on
//! every change) connects any wanted executor that has no live link, so a session that broke
//! while the executor stays registered is re-opened. While etcd is unreachable the watcher is
//! silent and the wanted state stays as last seen: serving goes on.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use ferry_runtime::cluster::{watch_members, ClusterArgs, MemberInfo, MemberKind, MembershipEvent};
use tokio::task::JoinHandle;

use crate::config::SchedulerConfig;
use crate::executors::ExecutorSet;

/// Keeps `set` equal to the executors registered in etcd until aborted, opening sessions as
/// `scheduler_id` under fencing `epoch`.
pub async fn run(
    cluster: ClusterArgs,
    config: SchedulerConfig,
    set: Arc<ExecutorSet>,
    scheduler_id: String,
    epoch: u64,
) {
    let client = cluster.client_patiently().await;
    let mut events = watch_members(client, cluster.prefix(MemberKind::Executor));
    let mut wanted = Wanted { config, set, scheduler_id, epoch, members: HashMap::new() };
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            ev = events.recv() => match ev {
                Some(ev) => wanted.apply(ev),
                None => return,
            },
            _ = tick.tick() => {}
        }
        wanted.reconcile();
    }
}

/// Keeps a session open to each of the executors listed by hand (`--executor`), reconnecting
/// (under `epoch` 0) when one is lost and comes back at the same address, until aborted.
pub async fn run_static(
    addresses: Vec<String>,
    config: SchedulerConfig,
    set: Arc<ExecutorSet>,
    scheduler_id: String,
) {
    let mut wanted = Wanted { config, set, scheduler_id, epoch: 0, members: HashMap::new() };
    let listed = addresses
        .into_iter()
        .map(|a| {
            let url = if a.contains("://") { a.clone() } else { format!("http://{a}") };
            (a, MemberInfo { address: url }.to_value())
        })
        .collect();
    wanted.apply(MembershipEvent::Snapshot(listed));
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        wanted.reconcile();
    }
}

/// A registered executor and the task connecting to it, if one runs.
struct Member {
    address: String,
    connecting: Option<JoinHandle<()>>,
}

struct Wanted {
    config: SchedulerConfig,
    set: Arc<ExecutorSet>,
    scheduler_id: String,
    epoch: u64,
    members: HashMap<String, Member>,
}

impl Wanted {
    fn apply(&mut self, ev: MembershipEvent) {
        match ev {
            MembershipEvent::Snapshot(list) => {
                let gone: Vec<String> = self
                    .members
                    .keys()
                    .filter(|name| !list.iter().any(|(n, _)| n == *name))
                    .cloned()
                    .collect();
                for name in gone {
                    self.forget(&name);
                }
                for (name, value) in list {
                    self.upsert(name, &value);
                }
            }
            MembershipEvent::Put(name, value) => self.upsert(name, &value),
            MembershipEvent::Delete(name) => self.forget(&name),
        }
    }

    fn upsert(&mut self, name: String, value: &str) {
        let info = match MemberInfo::from_value(value) {
            Ok(info) => info,
            Err(e) => {
                tracing::warn!(executor = %name, error = %e, "unreadable registration ignored");
                return;
            }
        };
        if self.members.get(&name).is_some_and(|m| m.address == info.address) {
            return; // a re-registration (new lease) of what we already have
        }
        tracing::info!(executor = %name, address = %info.address, "executor registered");
        if let Some(old) = self.members.remove(&name) {
            if let Some(task) = old.connecting {
                task.abort();
            }
            self.set.remove(&name, "it registered again at a new address");
        }
        self.members.insert(name, Member { address: info.address, connecting: None });
    }

    fn forget(&mut self, name: &str) {
        if let Some(m) = self.members.remove(name) {
            if let Some(task) = m.connecting {
                task.abort();
            }
            tracing::warn!(executor = %name, "executor deregistered (withdrew or its lease lapsed)");
            self.set.remove(name, "its etcd registration is gone (withdrawn or lease lapsed)");
        }
    }

    /// Starts a connection to every wanted executor without a live link or a connection under
    /// way.
    fn reconcile(&mut self) {
        for (name, m) in &mut self.members {
            if m.connecting.as_ref().is_some_and(|t| !t.is_finished()) {
                continue;
            }
            if self.set.contains_alive(name) {
                continue;
            }
            let (name, url, config, set) =
                (name.clone(), m.address.clone(), self.config.clone(), self.set.clone());
            let (scheduler_id, epoch) = (self.scheduler_id.clone(), self.epoch);
            m.connecting = Some(tokio::spawn(async move {
                let patience = Some(Duration::from_secs(config.executor_connect_timeout));
                let fence =
                    crate::Fence { scheduler_id: &scheduler_id, epoch, metrics: &set.metrics };
                match crate::connect_patiently(&name, &url, &config, fence, patience).await {
                    Ok(link) => {
                        tracing::info!(executor = %name, address = %url, "executor session open");
                        set.insert(link);
                    }
                    Err(e) => {
                        tracing::warn!(executor = %name, error = %e, "executor not reachable")
                    }
                }
            }));
        }
    }
}
