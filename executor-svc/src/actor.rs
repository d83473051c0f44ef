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
}

enum Command {
    Execute(Box<v1::Step>, oneshot::Sender<Result<v1::StepResult, StepError>>),
    Reset(oneshot::Sender<usize>),
    Stats(oneshot::Sender<EngineStats>),
}

/// A cheap handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
}

fn gone() -> Status {
    Status::unavailable("the executor's engine thread has stopped")
}

impl EngineHandle {
    /// Moves `engine` onto a new thread and returns its handle. The thread ends when every
    /// handle is dropped.
    pub fn spawn(mut engine: Engine) -> std::io::Result<Self> {
        let (tx, mut rx) = mpsc::channel::<Command>(64);
        std::thread::Builder::new().name("ferry-engine".into()).spawn(move || {
            while let Some(cmd) = rx.blocking_recv() {
                match cmd {
                    Command::Execute(step, reply) => {
                        let _ = reply.send(engine.execute(&step));
                    }
                    Command::Reset(reply) => {
                        let _ = reply.send(engine.reset());
                    }
                    Command::Stats(reply) => {
                        let _ = reply.send(EngineStats {
                            num_requests: engine.num_requests() as u32,
                            steps_executed: engine.steps_executed(),
                            blocks_in_use: engine.blocks_in_use() as u32,
                        });
                    }
                }
            }
        })?;
        Ok(Self { tx })
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

    /// Forgets every request; returns how many there were.
    pub async fn reset(&self) -> Result<usize, Status> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(Command::Reset(reply)).await.map_err(|_| gone())?;
        rx.await.map_err(|_| gone())
    }

    /// Current activity.
    pub async fn stats(&self) -> Result<EngineStats, Status> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(Command::Stats(reply)).await.map_err(|_| gone())?;
        rx.await.map_err(|_| gone())
    }
}
