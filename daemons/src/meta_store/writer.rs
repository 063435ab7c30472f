//! The store's writer thread ([`StoreWriter`]): the event loop hands it each batch
//! and goes on; it commits every batch waiting together (one fsync for all: a group
//! commit), then says how far it got and wakes the loop.

use super::*;

enum Msg {
    Job(Job),
    /// Answer once every job sent before is durable (shutdown).
    Sync(mpsc::Sender<()>),
}

/// The writer thread and what it has made durable.
pub struct StoreWriter {
    tx: Option<mpsc::Sender<Msg>>,
    thread: Option<std::thread::JoinHandle<()>>,
    next_seq: u64,
    /// The last job made durable, and the last core batch among them.
    durable_seq: Arc<AtomicU64>,
    durable_batch: Arc<AtomicU64>,
    /// A commit failed (it is retried; replies wait meanwhile).
    failing: Arc<AtomicBool>,
    /// Commits and jobs committed (group commit: jobs per commit).
    pub commits: Arc<AtomicU64>,
    pub jobs: Arc<AtomicU64>,
    /// The loop waits for the next commit: wake it after it.
    wanted: Arc<AtomicBool>,
}

/// How soon a failed commit is tried again.
const RETRY: Duration = Duration::from_secs(1);

impl StoreWriter {
    /// Starts the writer; it wakes the loop by calling `wake` after a commit the loop
    /// waits for ([`wake_when_durable`](Self::wake_when_durable)).
    /// `settle`: after that long, record that lease timeout for the next start
    /// ([`Loaded::lease_timeout_settles`]).
    pub fn start(
        store: MetaStore,
        wake: impl Fn() + Send + 'static,
        settle: Option<(Duration, u64)>,
    ) -> StoreWriter {
        let (tx, rx) = mpsc::channel::<Msg>();
        let durable_seq = Arc::new(AtomicU64::new(0));
        let durable_batch = Arc::new(AtomicU64::new(0));
        let failing = Arc::new(AtomicBool::new(false));
        let commits = Arc::new(AtomicU64::new(0));
        let jobs_n = Arc::new(AtomicU64::new(0));
        let wanted = Arc::new(AtomicBool::new(false));
        let (ds, db, fl, cm, jn, wn) = (
            durable_seq.clone(),
            durable_batch.clone(),
            failing.clone(),
            commits.clone(),
            jobs_n.clone(),
            wanted.clone(),
        );
        let thread = std::thread::Builder::new()
            .name("meta-store".into())
            .spawn(move || {
                let mut syncs: Vec<mpsc::Sender<()>> = Vec::new();
                let mut settle = settle.map(|(after, ms)| (Instant::now() + after, ms));
                loop {
                    let first = match settle {
                        Some((at, ms)) => {
                            match rx.recv_timeout(at.saturating_duration_since(Instant::now())) {
                                Ok(m) => m,
                                Err(mpsc::RecvTimeoutError::Timeout) => {
                                    match store.record_lease_timeout(ms) {
                                        Ok(()) => settle = None,
                                        Err(e) => {
                                            log::warn!(
                                                "cannot record the lease timeout: {e}; retrying"
                                            );
                                            settle = Some((Instant::now() + RETRY, ms));
                                        }
                                    }
                                    continue;
                                }
                                Err(mpsc::RecvTimeoutError::Disconnected) => break,
                            }
                        }
                        None => match rx.recv() {
                            Ok(m) => m,
                            Err(_) => break,
                        },
                    };
                    // Everything waiting goes into one commit: jobs that came while the
                    // last commit ran share this one (the loop itself gathers early
                    // answered changes for up to its lazy window before it sends them).
                    let mut jobs = Vec::new();
                    for m in std::iter::once(first).chain(rx.try_iter()) {
                        match m {
                            Msg::Job(j) => jobs.push(j),
                            Msg::Sync(s) => syncs.push(s),
                        }
                    }
                    if !jobs.is_empty() {
                        // The core leaves the JSON records' checks to the store: here,
                        // off the event loop.
                        for c in jobs.iter_mut().filter_map(|j| j.changes.as_mut()) {
                            c.seal();
                        }
                        let mut tries = 0u32;
                        while let Err(e) = store.commit(&jobs) {
                            tries += 1;
                            fl.store(true, Ordering::SeqCst);
                            if tries == 1 || tries % 60 == 0 {
                                log::error!(
                                    "cannot make the directory durable: {e}; retrying every {} s \
                                     (replies that change it wait)",
                                    RETRY.as_secs()
                                );
                            }
                            std::thread::sleep(RETRY);
                        }
                        fl.store(false, Ordering::SeqCst);
                        cm.fetch_add(1, Ordering::Relaxed);
                        jn.fetch_add(jobs.len() as u64, Ordering::Relaxed);
                        if let Some(b) = jobs
                            .iter()
                            .filter_map(|j| j.changes.as_ref())
                            .map(|c| c.batch)
                            .max()
                        {
                            db.fetch_max(b, Ordering::SeqCst);
                        }
                        if let Some(j) = jobs.last() {
                            ds.fetch_max(j.seq, Ordering::SeqCst);
                        }
                        // Only when the loop waits for a commit: a commit of early
                        // answered changes alone does not wake it (it sees how far the
                        // store got before its next request).
                        if wn.swap(false, Ordering::SeqCst) {
                            wake();
                        }
                    }
                    for s in syncs.drain(..) {
                        let _ = s.send(());
                    }
                }
                // The sender is gone: close the store cleanly (no repair at next start).
                drop(store);
            });
        let thread = match thread {
            Ok(t) => Some(t),
            Err(e) => {
                log::error!("cannot start the store thread: {e}");
                None
            }
        };
        StoreWriter {
            tx: Some(tx),
            thread,
            next_seq: 0,
            durable_seq,
            durable_batch,
            failing,
            commits,
            jobs: jobs_n,
            wanted,
        }
    }

    /// Wake the loop after the next commit (a reply or a freed page waits for it).
    /// Set it before looking at [`durable_seq`](Self::durable_seq): a commit that
    /// ends in between wakes the loop, one that ended before is seen there.
    pub fn wake_when_durable(&self) {
        self.wanted.store(true, Ordering::SeqCst);
    }

    /// Hands over a batch (and secret changes); returns its job number, durable once
    /// [`durable_seq`](Self::durable_seq) reaches it. The writer commits it at once
    /// with every job waiting (one commit for all of them).
    pub fn send(&mut self, changes: Option<Changes>, secrets: Vec<SecretOp>) -> u64 {
        self.next_seq += 1;
        let seq = self.next_seq;
        let job = Job {
            seq,
            changes,
            secrets,
        };
        if let Some(tx) = &self.tx {
            if tx.send(Msg::Job(job)).is_err() {
                log::error!("the store thread is gone: changes are no longer made durable");
            }
        }
        seq
    }

    pub fn durable_seq(&self) -> u64 {
        self.durable_seq.load(Ordering::SeqCst)
    }

    pub fn durable_batch(&self) -> u64 {
        self.durable_batch.load(Ordering::SeqCst)
    }

    pub fn sent_seq(&self) -> u64 {
        self.next_seq
    }

    pub fn is_failing(&self) -> bool {
        self.failing.load(Ordering::SeqCst)
    }

    /// Waits until every job sent so far is durable, at most `wait`.
    pub fn sync(&self, wait: Duration) -> bool {
        let Some(tx) = &self.tx else {
            return false;
        };
        let (stx, srx) = mpsc::channel();
        if tx.send(Msg::Sync(stx)).is_err() {
            return false;
        }
        srx.recv_timeout(wait).is_ok()
    }

    /// Stops the writer after what was sent, and closes the store.
    pub fn close(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for StoreWriter {
    fn drop(&mut self) {
        self.close();
    }
}
