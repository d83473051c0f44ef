//! The engine runs on a thread of its own: model steps are long, CPU-bound and must not stall
//! the async runtime that serves gRPC. RPC handlers talk to it through a channel; if the
//! thread is gone, calls fail with UNAVAILABLE rather than panicking.

use ferry_proto::v1;
use tokio::sync::{mpsc, oneshot};
use tonic::Status;

use crate::engine::{Engine, StepError};

/// Activity figures for `Describe`.
#[derive(Clone, Copy, Debug, Default)]
pub struct EngineStats {
    /// Requests held.
    pub num_requests: u32,
    /// Steps run since start.
    pub steps_executed: u64,
    /// Blocks referenced by held requests.
    pub blocks_in_use: u32,
    /// Time spent running steps, microseconds.
    pub busy_us: u64,
    /// Time spent waiting for the next step after one finished, microseconds.
    pub idle_us: u64,
    /// Time the steps took on the simulated GPU (`sim` backend), microseconds.
    pub simulated_us: u64,
    /// KV transfers started, by path (shared memory or the agent's socket).
    pub kv_paths: crate::engine::kv::KvPaths,
}

/// The engine's figures now.
fn stats_of(engine: &Engine, (busy_us, idle_us, simulated_us): (u64, u64, u64)) -> EngineStats {
    EngineStats {
        num_requests: engine.num_requests() as u32,
        steps_executed: engine.steps_executed(),
        blocks_in_use: engine.blocks_in_use() as u32,
        busy_us,
        idle_us,
        simulated_us,
        kv_paths: engine.kv_paths(),
    }
}

enum Command {
    Execute(Box<v1::Step>, oneshot::Sender<Result<v1::StepResult, StepError>>),
    Reset(oneshot::Sender<(usize, Vec<v1::CachedBlock>)>),
    Stats(oneshot::Sender<EngineStats>),
}

/// What the engine thread publishes after every command, for metrics (read without a round
/// trip to the thread).
#[derive(Debug)]
pub struct Published {
    /// The activity figures as of the last command.
    pub stats: std::sync::Mutex<EngineStats>,
    /// Duration of each step run, seconds.
    pub step_seconds: ferry_runtime::prometheus::Histogram,
}

/// A cheap handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
    published: std::sync::Arc<Published>,
}

fn gone() -> Status {
    Status::unavailable("the executor's engine thread has stopped")
}

impl EngineHandle {
    /// Moves `engine` onto a new thread and returns its handle. The thread ends when every
    /// handle is dropped.
    pub fn spawn(mut engine: Engine) -> std::io::Result<Self> {
        let (tx, mut rx) = mpsc::channel::<Command>(64);
        let published = std::sync::Arc::new(Published {
            stats: std::sync::Mutex::new(EngineStats::default()),
            step_seconds: ferry_runtime::prometheus::Histogram::new(
                ferry_runtime::prometheus::STEP_BUCKETS,
            ),
        });
        let shared = published.clone();
        std::thread::Builder::new().name("ferry-engine".into()).spawn(move || {
            let (mut busy_us, mut idle_us, mut simulated_us) = (0u64, 0u64, 0u64);
            // When the last step finished; idle time is counted from there to the next step.
            let mut last_done: Option<std::time::Instant> = None;
            while let Some(cmd) = rx.blocking_recv() {
                match cmd {
                    Command::Execute(step, reply) => {
                        let start = std::time::Instant::now();
                        let idle =
                            last_done.map_or(0, |t| start.duration_since(t).as_micros() as u64);
                        idle_us += idle;
                        let mut result = engine.execute(&step);
                        if let Ok(r) = &mut result {
                            if let Some(t) = r.timing.as_mut() {
                                t.idle_us = idle;
                                simulated_us += t.simulated_us;
                            }
                        }
                        let done = std::time::Instant::now();
                        busy_us += done.duration_since(start).as_micros() as u64;
                        shared.step_seconds.observe(done.duration_since(start).as_secs_f64());
                        // Waiting counts as idle only while requests are held: a gap with no
                        // request is no load, not the scheduler keeping the executor waiting.
                        last_done = (engine.num_requests() > 0).then_some(done);
                        let _ = reply.send(result);
                    }
                    Command::Reset(reply) => {
                        last_done = None;
                        let dropped = engine.reset();
                        let _ = reply.send((dropped, engine.cached_blocks()));
                    }
                    Command::Stats(reply) => {
                        let _ = reply.send(stats_of(&engine, (busy_us, idle_us, simulated_us)));
                    }
                }
                let now = stats_of(&engine, (busy_us, idle_us, simulated_us));
                *shared.stats.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = now;
            }
        })?;
        Ok(Self { tx, published })
    }

    /// Runs one step.
    pub async fn execute(
        &self,
        step: v1::Step,
    ) -> Result<Result<v1::StepResult, StepError>, Status> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(Command::Execute(Box::new(step), reply)).await.map_err(|_| gone())?;
        rx.await.map_err(|_| gone())
    }

    /// Forgets every request; returns how many there were, and the blocks cached (see
    /// `Engine::cached_blocks`).
    pub async fn reset(&self) -> Result<(usize, Vec<v1::CachedBlock>), Status> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(Command::Reset(reply)).await.map_err(|_| gone())?;
        rx.await.map_err(|_| gone())
    }

    /// What the engine thread last published.
    pub fn published(&self) -> &Published {
        &self.published
    }

    /// Current activity.
    pub async fn stats(&self) -> Result<EngineStats, Status> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(Command::Stats(reply)).await.map_err(|_| gone())?;
        rx.await.map_err(|_| gone())
    }
}
