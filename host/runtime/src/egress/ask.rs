//! Network mode `ask`: a connection to a name outside the session's allowlist waits while the
//! user is asked (a `permission_request` of kind `network`), then goes ahead or is refused. One
//! question per name at a time: further connections to it wait for the same answer. A name
//! allowed "for the session" is not asked again while this umbrad runs the session.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use umbra_api::event::PermissionScope;
use umbra_proto::egress::{EgressProcess, EgressVia};

/// What a connection waiting in mode `ask` is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Question {
    /// The name (normalised) or address.
    pub host: String,
    pub port: u16,
    pub via: EgressVia,
    /// The guest process that opened it, as the guest's agent reports it (tidied).
    pub process: Option<EgressProcess>,
}

/// Asks the user a [`Question`]; resolves to the scope of an approval or why there is none.
pub type Asker = Arc<
    dyn Fn(Question, Duration) -> Pin<Box<dyn Future<Output = Result<PermissionScope, String>> + Send>> + Send + Sync,
>;

type Answer = Option<Result<(), String>>;

pub struct AskGate {
    asker: Asker,
    /// Names allowed for the session (kept by the session across its VMs).
    approved: Arc<Mutex<HashSet<String>>>,
    /// The question being asked about each name, for the connections that wait on it.
    asking: Mutex<HashMap<String, watch::Receiver<Answer>>>,
}

impl std::fmt::Debug for AskGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AskGate").field("approved", &self.approved.lock().unwrap().len()).finish_non_exhaustive()
    }
}

impl AskGate {
    pub fn new(asker: Asker, approved: Arc<Mutex<HashSet<String>>>) -> Self {
        Self { asker, approved, asking: Mutex::new(HashMap::new()) }
    }

    /// Whether `host` (normalised) is allowed for the session already: nothing will be asked.
    pub fn approved(&self, host: &str) -> bool {
        self.approved.lock().unwrap().contains(host)
    }

    /// Returns once the question's host may be connected to, or why not.
    pub async fn check(&self, question: Question, timeout: Duration) -> Result<(), String> {
        let host = question.host.as_str();
        if self.approved(host) {
            return Ok(());
        }
        let (mut waiting, asks) = {
            let mut asking = self.asking.lock().unwrap();
            match asking.get(host) {
                Some(rx) => (rx.clone(), None),
                None => {
                    let (tx, rx) = watch::channel(None);
                    asking.insert(host.to_string(), rx.clone());
                    (rx, Some(tx))
                }
            }
        };
        if let Some(tx) = asks {
            // This connection asks; if it goes away meanwhile, the others hear "dropped".
            let _done = Forget { gate: self, host };
            let answer = (self.asker)(question.clone(), timeout).await;
            if matches!(answer, Ok(PermissionScope::Session | PermissionScope::Always)) {
                self.approved.lock().unwrap().insert(host.to_string());
            }
            let answer = answer.map(drop);
            let _ = tx.send(Some(answer.clone()));
            return answer;
        }
        loop {
            if let Some(answer) = waiting.borrow().clone() {
                return answer;
            }
            if waiting.changed().await.is_err() {
                return Err("the question about it was dropped".into());
            }
        }
    }
}

/// Removes a name's question when its asker is done (or dropped).
struct Forget<'a> {
    gate: &'a AskGate,
    host: &'a str,
}

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        self.gate.asking.lock().unwrap().remove(self.host);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn gate(answer: Result<PermissionScope, String>) -> (Arc<AskGate>, Arc<AtomicUsize>) {
        let asked = Arc::new(AtomicUsize::new(0));
        let count = asked.clone();
        let asker: Asker = Arc::new(move |_, _| {
            count.fetch_add(1, Ordering::SeqCst);
            let answer = answer.clone();
            Box::pin(async move {
                tokio::time::sleep(Duration::from_millis(50)).await;
                answer
            })
        });
        (Arc::new(AskGate::new(asker, Default::default())), asked)
    }

    fn q(host: &str, port: u16, via: EgressVia) -> Question {
        Question { host: host.into(), port, via, process: None }
    }

    #[tokio::test]
    async fn one_question_per_name_and_a_session_approval_is_kept() {
        let (g, asked) = gate(Ok(PermissionScope::Session));
        let (a, b) = tokio::join!(
            g.check(q("x.test", 443, EgressVia::Http), Duration::from_secs(5)),
            g.check(q("x.test", 443, EgressVia::Transparent), Duration::from_secs(5))
        );
        assert_eq!((a, b), (Ok(()), Ok(())));
        assert_eq!(asked.load(Ordering::SeqCst), 1, "two connections, one question");
        g.check(q("x.test", 80, EgressVia::Http), Duration::from_secs(5)).await.unwrap();
        assert_eq!(asked.load(Ordering::SeqCst), 1, "approved for the session: not asked again");

        let (g, asked) = gate(Ok(PermissionScope::Once));
        g.check(q("y.test", 443, EgressVia::Http), Duration::from_secs(5)).await.unwrap();
        g.check(q("y.test", 443, EgressVia::Http), Duration::from_secs(5)).await.unwrap();
        assert_eq!(asked.load(Ordering::SeqCst), 2, "once means once");

        let (g, _) = gate(Err("denied by the user".into()));
        let e = g.check(q("z.test", 443, EgressVia::Http), Duration::from_secs(5)).await.unwrap_err();
        assert_eq!(e, "denied by the user");
    }
}
