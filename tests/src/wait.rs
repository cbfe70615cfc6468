//! Waiting in tests: the one step a test waits for an expected message, and polling a
//! condition until it holds.

use std::time::Duration;

/// How long a test waits for any one expected message.
pub const STEP: Duration = Duration::from_secs(30);

/// Polls `cond` every 20 ms until it holds or `within` passes; its last answer.
pub async fn wait_until(within: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    while tokio::time::Instant::now() < deadline {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cond()
}

/// [`wait_until`] for a condition that must await (a metric, `/readyz`, a process' state over
/// a socket): polls every 20 ms until it holds or `within` passes; its last answer.
pub async fn wait_until_async<F, Fut>(within: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + within;
    while tokio::time::Instant::now() < deadline {
        if cond().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cond().await
}
