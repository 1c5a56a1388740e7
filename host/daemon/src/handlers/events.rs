//! `events.*`: lifecycle event subscriptions, forwarded to the client in bus order.

use std::sync::Arc;

use serde_json::Value;
use umbra_api::methods::{Done, EventsSubscribe, EventsUnsubscribe, Method, SubscribeParams, Subscribed};
use umbra_api::rpc::{NOTIFY_EVENT, NOTIFY_LOST};
use umbra_api::{ApiError, ErrorCode, SessionEvent};

use super::common::{call, Outcome};
use crate::client::{Connection, Subscription};

/// Handles this module's methods; `None` for any other.
pub async fn handle(conn: &Arc<Connection>, method: &str, params: Option<Value>) -> Option<Outcome> {
    Some(match method {
        EventsSubscribe::NAME => call::<EventsSubscribe, _, _>(params, |p| async move { Ok(subscribe(conn, p)) }).await,
        EventsUnsubscribe::NAME => {
            call::<EventsUnsubscribe, _, _>(params, |p| async move {
                match conn.subscriptions.lock().unwrap().remove(&p.subscription) {
                    Some(subscription) => {
                        subscription.task.abort();
                        Ok(Done {})
                    }
                    None => Err(ApiError::new(ErrorCode::NotFound, format!("no subscription {}", p.subscription))),
                }
            })
            .await
        }
        _ => return None,
    })
}

/// Forwards lifecycle events (of one session, or all) to this client until it unsubscribes or
/// goes away. A client that reads too slowly loses the oldest events and is told how many.
fn subscribe(conn: &Arc<Connection>, p: SubscribeParams) -> Subscribed {
    let id = conn.new_subscription_id();
    let (mut rx, start) = conn.daemon.manager.subscribe_counted();
    // How far it has got: responses to this client wait for it (`Connection::respond`).
    let (position, position_rx) = tokio::sync::watch::channel(start);
    let weak = Arc::downgrade(conn);
    let task = tokio::spawn(async move {
        let mut at = start;
        loop {
            let event: SessionEvent = match rx.recv().await {
                Ok(e) => e,
                Err(tokio::sync::broadcast::error::RecvError::Lagged(count)) => {
                    let Some(conn) = weak.upgrade() else { return };
                    if !conn.notify(NOTIFY_LOST, umbra_api::rpc::EventsLost { count }).await {
                        return;
                    }
                    at += count;
                    position.send_replace(at);
                    continue;
                }
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            };
            at += 1;
            if p.session.as_ref().is_none_or(|s| event.session.as_ref() == Some(s)) {
                let Some(conn) = weak.upgrade() else { return };
                if !conn.notify(NOTIFY_EVENT, &event).await {
                    return;
                }
            }
            position.send_replace(at);
        }
    });
    let subscription = Subscription { task: task.abort_handle(), position: position_rx };
    conn.subscriptions.lock().unwrap().insert(id, subscription);
    Subscribed { subscription: id }
}
