//! Published views of the applied state: what every reader reads.
//!
//! The state machine applies entries to its own copy of [`State`] (the
//! *master*), which only apply touches. After each applied batch it hands the
//! commands to a maintainer thread, which brings a second copy up to date and
//! publishes it as an immutable [`View`] behind an `Arc`; the view it replaces
//! becomes the next one brought up to date (left-right, RCU-style). A reader
//! takes the current view (a pointer copy under a lock held for nanoseconds)
//! and reads it for as long as it likes without holding anything that apply,
//! a heartbeat or another reader needs.
//!
//! ```text
//!  apply ──► master State ──(index, command)──► queue ──► maintainer thread
//!                                                           │ applies them to the spare view
//!                                                           ▼
//!  readers ◄── Arc<View> (published) ◄──────────── swap; the old one is the next spare
//! ```
//!
//! A view lags the master by the time the maintainer takes to apply a batch
//! (microseconds to milliseconds). A read that must see everything applied
//! so far (after a write, or a linearizable read) waits for the view that
//! covers it ([`super::SharedState::read_fresh`]).
//!
//! A spare is reused only once its last reader let it go. The maintainer
//! keeps [`SPARES_MAX`] spares (the views it replaced last) and takes
//! whichever is free first, waiting at most [`SPARE_WAIT_MAX`] for one; only
//! when readers hold every spare that long (a scheduling analysis, or, on a
//! machine short of cores, readers whose threads were not scheduled) does it
//! clone the newest view instead, never making the others wait. Writes'
//! answers wait for the view that has them, so a clone (tens of
//! milliseconds at tens of thousands of jobs) delays every write behind it.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

use gangway_core::{Command, State};

/// Commands the maintainer may fall behind by before the views are taken
/// anew from the master instead (a clone under the master's read lock): a
/// batch of exits or submits counts as one command, so this is minutes of a
/// 10,000-node cluster's writes; the maintainer falls behind by a few.
pub const VIEW_QUEUE_COMMANDS_MAX: usize = 65_536;
/// And the bytes they may hold (a submit may carry a script of megabytes).
pub const VIEW_QUEUE_BYTES_MAX: usize = 256 << 20;
/// Views replaced by newer ones that the maintainer keeps to reuse: one more
/// than the one it is bound to reuse next, so a reader descheduled while it
/// holds that one (a heartbeat's answer on a busy machine) does not cost a
/// clone of the whole state. Each costs a copy of the state's maps (the
/// scripts and environments are shared).
pub const SPARES_MAX: usize = 2;
/// Log entries a spare still read may fall behind the published view before
/// the maintainer lets it go (and makes up another, a clone, once a view is
/// published): the queue keeps every command after the oldest spare, so this
/// bounds it while a reader holds a view (an analysis's pass) far longer
/// than a heartbeat's answer does.
pub const SPARE_LAG_MAX: u64 = 1_024;
/// How long the maintainer waits for the readers of a spare view to let it
/// go before it clones the newest view instead. Reads are bounded (a page of
/// a listing, a heartbeat's orders): they finish well within this.
pub const SPARE_WAIT_MAX: Duration = Duration::from_millis(20);
/// How long a read that must be fresh waits for the view that covers what
/// was applied when it asked; past it the read is refused as UNAVAILABLE
/// (the maintainer is minutes behind: something is badly wrong).
pub const FRESH_WAIT_MAX: Duration = Duration::from_secs(5);
/// How often an idle maintainer looks whether it should stop.
const IDLE_CHECK: Duration = Duration::from_secs(1);

/// The state as of one log index; immutable once published.
#[derive(Clone)]
pub struct View {
    state: State,
    index: u64,
}

impl View {
    pub(crate) fn new(state: State, index: u64) -> View {
        View { state, index }
    }

    /// The log index this view reflects.
    pub fn index(&self) -> u64 {
        self.index
    }

    pub fn state(&self) -> &State {
        &self.state
    }
}

impl std::ops::Deref for View {
    type Target = State;
    fn deref(&self) -> &State {
        &self.state
    }
}

/// The master state and the log index it reflects, both written by apply
/// under the write lock.
pub(crate) struct Master {
    pub(crate) state: RwLock<State>,
    pub(crate) applied: std::sync::atomic::AtomicU64,
}

impl Master {
    pub(crate) fn applied(&self) -> u64 {
        self.applied.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// What apply handed the maintainer.
struct Queue {
    /// Commands with index > `from`, oldest first.
    commands: VecDeque<(u64, Arc<Command>)>,
    /// Every command after this index is in `commands`.
    from: u64,
    bytes: usize,
    /// The index the master reflects after them (blank and membership
    /// entries move it without a command).
    latest: u64,
    /// The master was replaced (a snapshot) or the queue overflowed: the
    /// views are taken anew from the master.
    rebuild: bool,
    stop: bool,
}

impl Queue {
    /// Queues what apply just did, or, past VIEW_QUEUE_COMMANDS_MAX commands
    /// or VIEW_QUEUE_BYTES_MAX bytes queued, drops the queue and has the
    /// views taken anew from the master.
    fn push(&mut self, commands: Vec<(u64, Arc<Command>)>, latest: u64) {
        if !self.rebuild {
            let bytes = self.bytes.saturating_add(commands.iter().map(|(_, c)| c.approx_bytes()).sum());
            if self.commands.len().saturating_add(commands.len()) > VIEW_QUEUE_COMMANDS_MAX
                || bytes > VIEW_QUEUE_BYTES_MAX
            {
                self.commands = VecDeque::new();
                self.bytes = 0;
                self.rebuild = true;
            } else {
                self.commands.extend(commands);
                self.bytes = bytes;
            }
        }
        self.latest = self.latest.max(latest);
    }
}

/// Counters for telemetry and tests.
#[derive(Default, Debug, Clone, Copy, PartialEq, Eq)]
pub struct ViewStats {
    /// Views published.
    pub published: u64,
    /// Views cloned: because every spare was still read (or there was none
    /// yet), or to make up the spares (SPARES_MAX) after a start or a rebuild.
    pub clones: u64,
    /// Times the views were taken anew from the master.
    pub rebuilds: u64,
    /// Commands queued for the maintainer now (those the oldest spare still
    /// needs, and any not yet published).
    pub queued: u64,
}

pub(crate) struct Views {
    published: Mutex<Arc<View>>,
    queue: Mutex<Queue>,
    wake: Condvar,
    index: tokio::sync::watch::Sender<u64>,
    stats: Mutex<ViewStats>,
}

impl Views {
    /// Publishes `first` and starts the maintainer, which runs until [`Views::stop`].
    pub(crate) fn start(first: View, master: Arc<Master>) -> Arc<Views> {
        let index = first.index;
        let views = Arc::new(Views {
            published: Mutex::new(Arc::new(first)),
            queue: Mutex::new(Queue {
                commands: VecDeque::new(),
                from: index,
                bytes: 0,
                latest: index,
                rebuild: false,
                stop: false,
            }),
            wake: Condvar::new(),
            index: tokio::sync::watch::Sender::new(index),
            stats: Mutex::new(ViewStats::default()),
        });
        let v = views.clone();
        std::thread::Builder::new()
            .name("gangway-views".into())
            .spawn(move || maintain(&v, &master))
            .expect("spawning the view maintainer thread");
        views
    }

    pub(crate) fn stop(&self) {
        self.queue.lock().expect("view queue lock").stop = true;
        self.wake.notify_all();
    }

    /// The newest published view.
    pub(crate) fn current(&self) -> Arc<View> {
        self.published.lock().expect("published view lock").clone()
    }

    pub(crate) fn stats(&self) -> ViewStats {
        let mut stats = *self.stats.lock().expect("view stats lock");
        stats.queued = u64::try_from(self.queue.lock().expect("view queue lock").commands.len()).unwrap_or(u64::MAX);
        stats
    }

    pub(crate) fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.index.subscribe()
    }

    /// Hands the maintainer what apply just did. Called under the master's
    /// write lock, so the queue and the master always agree.
    pub(crate) fn push(&self, commands: Vec<(u64, Arc<Command>)>, latest: u64) {
        self.queue.lock().expect("view queue lock").push(commands, latest);
        self.wake.notify_one();
    }

    /// The master was replaced wholesale. Called under its write lock.
    pub(crate) fn rebuild(&self, latest: u64) {
        let mut q = self.queue.lock().expect("view queue lock");
        q.commands = VecDeque::new();
        q.bytes = 0;
        q.rebuild = true;
        q.latest = latest;
        drop(q);
        self.wake.notify_one();
    }

    fn publish(&self, view: View) -> Arc<View> {
        let index = view.index;
        let old = std::mem::replace(&mut *self.published.lock().expect("published view lock"), Arc::new(view));
        self.index.send_replace(index);
        self.stats.lock().expect("view stats lock").published += 1;
        old
    }

    fn count(&self, f: impl FnOnce(&mut ViewStats)) {
        f(&mut self.stats.lock().expect("view stats lock"));
    }
}

/// What the maintainer does next.
enum Work {
    Rebuild,
    CatchUp,
}

/// The maintainer's loop: wait for applied commands, bring the spare view up
/// to date, publish it.
fn maintain(views: &Views, master: &Master) {
    // In index order, oldest first; none newer than the published view.
    let mut spares: VecDeque<Arc<View>> = VecDeque::new();
    loop {
        let work = {
            let mut q = views.queue.lock().expect("view queue lock");
            loop {
                if q.stop {
                    return;
                }
                if q.rebuild {
                    break Work::Rebuild;
                }
                if q.latest > *views.index.borrow() {
                    break Work::CatchUp;
                }
                q = views.wake.wait_timeout(q, IDLE_CHECK).expect("view queue lock").0;
            }
        };
        match work {
            Work::Rebuild => {
                // Under the master's read lock apply cannot run, so every
                // command queued so far is in the copy.
                let view = {
                    let state = master.state.read().expect("state lock poisoned");
                    let mut q = views.queue.lock().expect("view queue lock");
                    let index = master.applied();
                    q.commands = VecDeque::new();
                    q.bytes = 0;
                    q.from = index;
                    q.latest = index;
                    q.rebuild = false;
                    View { state: state.clone(), index }
                };
                views.publish(view);
                spares.clear();
                views.count(|s| s.rebuilds += 1);
            }
            Work::CatchUp => {
                let mut view = match take_free_spare(&mut spares) {
                    Some(v) => v,
                    // Every spare still read, or none yet: the newest view, cloned.
                    None => {
                        views.count(|s| s.clones += 1);
                        View::clone(&views.current())
                    }
                };
                let (commands, latest) = {
                    let q = views.queue.lock().expect("view queue lock");
                    if q.rebuild {
                        continue;
                    }
                    if q.from > view.index {
                        // Cannot happen (the queue keeps what the spare
                        // needs); take the views anew rather than guess.
                        drop(q);
                        views.rebuild(master.applied());
                        continue;
                    }
                    let commands: Vec<(u64, Arc<Command>)> =
                        q.commands.iter().filter(|(i, _)| *i > view.index).cloned().collect();
                    (commands, q.latest)
                };
                for (index, cmd) in &commands {
                    view.state.apply(*index, cmd);
                }
                view.index = latest;
                let old = views.publish(view);
                spares.push_back(old);
                // The oldest spare goes past SPARES_MAX, or while still read
                // once it is SPARE_LAG_MAX entries behind (the queue keeps
                // every command after it): its readers drop it.
                while spares.len() > SPARES_MAX
                    || spares
                        .front()
                        .is_some_and(|v| Arc::strong_count(v) > 1 && latest.saturating_sub(v.index) > SPARE_LAG_MAX)
                {
                    spares.pop_front();
                }
                if spares.len() < SPARES_MAX {
                    // One more view to reuse (after a start, a rebuild, or
                    // a spare let go while still read), made now that the
                    // writes waiting for this view have it: a held spare
                    // then never means a clone on their path.
                    views.count(|s| s.clones += 1);
                    spares.push_back(Arc::new(View::clone(&views.current())));
                }
                // What the oldest spare still needs.
                let needed_from = spares.iter().map(|v| v.index).min().unwrap_or(latest);
                let mut q = views.queue.lock().expect("view queue lock");
                while q.commands.front().is_some_and(|(i, _)| *i <= needed_from) {
                    if let Some((_, c)) = q.commands.pop_front() {
                        q.bytes = q.bytes.saturating_sub(c.approx_bytes());
                    }
                }
                q.from = q.from.max(needed_from);
                drop(q);
            }
        }
    }
}

/// The oldest of `spares` (kept in index order) that nobody reads any
/// more, taken out of them, waiting at most [`SPARE_WAIT_MAX`] for one to be
/// let go; `None` if readers still hold every one then (or there is none).
/// The oldest first, so the spares take turns and the queue is trimmed past
/// each in turn (an older one still read stays, within SPARE_LAG_MAX). Nobody
/// can take a new reference to a spare: only the published view is handed out.
fn take_free_spare(spares: &mut VecDeque<Arc<View>>) -> Option<View> {
    if spares.is_empty() {
        return None;
    }
    let deadline = Instant::now() + SPARE_WAIT_MAX;
    let mut pause = Duration::from_micros(20);
    loop {
        if let Some(i) = spares.iter().position(|v| Arc::strong_count(v) == 1) {
            let free = spares.remove(i)?;
            match Arc::try_unwrap(free) {
                Ok(view) => return Some(view),
                // Cannot happen (nobody can take a new reference): let it go too.
                Err(_) => continue,
            }
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(2));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue() -> Queue {
        Queue { commands: VecDeque::new(), from: 0, bytes: 0, latest: 0, rebuild: false, stop: false }
    }

    fn command() -> Arc<Command> {
        Arc::new(Command::DrawHistory { history: 1, now_ms: 0 })
    }

    /// The maintainer's queue holds VIEW_QUEUE_COMMANDS_MAX commands; one
    /// more and it is dropped, the views to be taken anew from the master.
    #[test]
    fn the_view_queue_holds_its_commands_max_and_one_more_rebuilds() {
        let mut q = queue();
        q.push((1..=VIEW_QUEUE_COMMANDS_MAX as u64).map(|i| (i, command())).collect(), VIEW_QUEUE_COMMANDS_MAX as u64);
        assert_eq!((q.commands.len(), q.rebuild), (VIEW_QUEUE_COMMANDS_MAX, false));
        let next = VIEW_QUEUE_COMMANDS_MAX as u64 + 1;
        q.push(vec![(next, command())], next);
        assert_eq!((q.commands.len(), q.bytes, q.rebuild, q.latest), (0, 0, true, next));
        // Nothing is queued until the rebuild, but the index still moves.
        q.push(vec![(next + 1, command())], next + 1);
        assert_eq!((q.commands.len(), q.latest), (0, next + 1));
    }

    /// The queue holds commands of VIEW_QUEUE_BYTES_MAX bytes; a byte more
    /// and it is dropped, the views to be taken anew.
    #[test]
    fn the_view_queue_holds_its_bytes_max_and_one_more_rebuilds() {
        let size = command().approx_bytes();
        let mut q = queue();
        q.bytes = VIEW_QUEUE_BYTES_MAX - size;
        q.push(vec![(1, command())], 1);
        assert_eq!((q.commands.len(), q.bytes, q.rebuild), (1, VIEW_QUEUE_BYTES_MAX, false));
        let mut q = queue();
        q.bytes = VIEW_QUEUE_BYTES_MAX + 1 - size;
        q.push(vec![(1, command())], 1);
        assert_eq!((q.commands.len(), q.bytes, q.rebuild), (0, 0, true));
    }

    /// A spare view still read is waited for at most SPARE_WAIT_MAX (then
    /// the maintainer clones instead); a free one is taken.
    #[test]
    fn a_spare_still_read_is_waited_for_at_most_spare_wait_max() {
        let free = Arc::new(View::new(State::default(), 1));
        let mut spares = VecDeque::from([free]);
        assert_eq!(take_free_spare(&mut spares).map(|v| v.index()), Some(1));
        let held = Arc::new(View::new(State::default(), 2));
        let mut spares = VecDeque::from([held.clone()]);
        let started = Instant::now();
        assert!(take_free_spare(&mut spares).is_none());
        let waited = started.elapsed();
        assert!(waited >= SPARE_WAIT_MAX && waited < SPARE_WAIT_MAX * 50, "waited {waited:?}");
        assert_eq!(spares.len(), 1, "the held spare stays");
    }
}
