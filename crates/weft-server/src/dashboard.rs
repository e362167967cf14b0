//! The dashboard: `GET /` answers one page (embedded in the binary; plain HTML and script,
//! no library, nothing fetched from elsewhere) that follows `/v1/dashboard/events`, the
//! cluster view, the model and the live counters once a second, and chats through the
//! server's own OpenAI endpoint.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::Html;
use futures_util::stream::{self, Stream};

use crate::state::AppState;

const PAGE: &str = include_str!("../assets/dashboard.html");

/// How often the page hears from the server.
const EVERY: Duration = Duration::from_secs(1);

pub async fn page() -> Html<&'static str> {
    Html(PAGE)
}

/// The cluster view with the model and the live counters, now and then once a second.
pub async fn events(
    State(st): State<Arc<AppState>>,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let updates = stream::unfold((st, true), |(st, first)| async move {
        if !first {
            tokio::time::sleep(EVERY).await;
        }
        // A server shutting down (or whose engine died) ends the stream.
        if st.closing.load(Ordering::Relaxed) || st.engine.stopped().is_some() {
            return None;
        }
        let view = st.cluster_json();
        let ev = SseEvent::default().event("cluster").data(view.to_string());
        Some((Ok(ev), (st, false)))
    });
    Sse::new(updates).keep_alive(KeepAlive::default())
}
