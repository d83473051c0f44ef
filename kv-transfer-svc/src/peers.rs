//! gRPC clients of agents, with the large HTTP/2 windows and message limits block streams need
//! (executors use them for `Put` and `Get`; agents push to each other over
//! [`ferry_kv_wire::data_channel`]).

use std::time::Duration;

use ferry_kv_wire::frames::MAX_MESSAGE_BYTES;
use ferry_proto::v1::kv_transfer_client::KvTransferClient;
use ferry_runtime::grpc::{BULK_CONNECTION_WINDOW, BULK_FRAME_SIZE, BULK_STREAM_WINDOW};
use ferry_runtime::tls;
use tonic::transport::Channel;
use tonic::Status;

/// A client for block streams to the agent at `address` (`host:port` or a URL), connecting
/// lazily.
pub fn client(address: &str) -> Result<KvTransferClient<Channel>, Status> {
    let endpoint = tls::endpoint(address)
        .map_err(|e| Status::invalid_argument(format!("agent address {address:?}: {e}")))?
        .connect_timeout(Duration::from_secs(2))
        .initial_stream_window_size(BULK_STREAM_WINDOW)
        .initial_connection_window_size(BULK_CONNECTION_WINDOW)
        .max_frame_size(BULK_FRAME_SIZE)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(5))
        .keep_alive_timeout(Duration::from_secs(5));
    let channel = tls::connect_lazy(&endpoint, tls::Role::KvAgent);
    Ok(wrap(channel))
}

/// Applies the block-stream message limits to a client over `channel`.
pub fn wrap(channel: Channel) -> KvTransferClient<Channel> {
    KvTransferClient::new(channel)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES)
}
