//! A lane: a device's worker thread, started (and filtered) with the device, that runs the
//! jobs it is handed later — at activation, on a vCPU thread, which may not create threads.

use std::io;
use std::sync::mpsc;

use super::ThreadKind;

type Job = Box<dyn FnOnce() + Send>;

/// A thread of one [`ThreadKind`] waiting for jobs; it ends when the lane is dropped.
#[derive(Debug)]
pub struct Lane {
    jobs: mpsc::Sender<Job>,
    name: String,
}

/// A job handed to a lane: [`Running::join`] waits for its result, like a thread's handle.
#[derive(Debug)]
pub struct Running<T> {
    done: mpsc::Receiver<std::thread::Result<T>>,
}

impl Lane {
    /// Starts the thread `name`; it installs `kind`'s filter before anything else. A thread
    /// whose filter cannot be installed ends the process: it must never run unfiltered.
    pub fn start(kind: ThreadKind, name: &str) -> io::Result<Lane> {
        let (jobs, queue) = mpsc::channel::<Job>();
        super::spawn_filtered(kind, name, move || {
            while let Ok(job) = queue.recv() {
                job();
            }
        })?;
        Ok(Lane { jobs, name: name.to_string() })
    }

    /// Runs `job` on the lane's thread, after the jobs handed to it before. A job that panics
    /// reports the panic through its [`Running`], and the lane goes on.
    pub fn run<T, F>(&self, job: F) -> io::Result<Running<T>>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        let (tx, done) = mpsc::sync_channel(1);
        let wrapped: Job = Box::new(move || {
            let _ = tx.send(std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)));
        });
        self.jobs.send(wrapped).map_err(|_| io::Error::other(format!("the {} thread has ended", self.name)))?;
        Ok(Running { done })
    }
}

impl<T> Running<T> {
    /// Waits for the job; `Err` if it panicked (or its lane ended first).
    pub fn join(self) -> std::thread::Result<T> {
        self.done.recv().unwrap_or_else(|_| Err(Box::new("the lane ended before the job ran")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_run_in_order_on_one_thread_and_a_panic_is_reported() {
        let lane = Lane::start(ThreadKind::Block, "test-lane").unwrap();
        let a = lane.run(|| std::thread::current().name().map(str::to_string)).unwrap();
        let b = lane.run(|| panic!("boom")).unwrap();
        let c = lane.run(|| 7).unwrap();
        assert_eq!(a.join().unwrap().as_deref(), Some("test-lane"));
        assert!(b.join().is_err());
        assert_eq!(c.join().unwrap(), 7, "the lane survives a panicking job");
    }
}
