//! `IoObserver`: what a real device does at the system-call boundary, reported as it happens,
//! for power-loss tests (tests/power_loss.rs).
//!
//! A real device (`uring`, `sync`) with an observer attached reports, in the order it makes them:
//! the files it opens, the sizes it makes durable, each write it hands to the kernel (with its
//! bytes), each write's completion as the device learns of it, and the start and end of every
//! fdatasync. From that record a test can build every disk image a power loss could leave at any
//! moment: a write is sure to survive only if it completed before an fdatasync of its file began
//! and that fdatasync finished; every other write may be there, missing, or torn. So the record
//! checks the device's own bookkeeping of what a flush covers, which no test above the device can
//! see (kill -9 loses nothing the page cache and the disk cache still hold).
//!
//! Invariants:
//! - Events of one device are reported from its thread, in program order; a write's completion is
//!   reported when the device drains it from the kernel, never earlier than the kernel finished it.
//! - With no observer attached a device does no extra work beyond one `Option` check per event.

/// Receives the events of every device it is attached to (one per shard thread), so it must
/// order them itself (a mutex around a log is what the tests use).
pub trait IoObserver: Send + Sync {
    /// A file was opened, holding `len_bytes` (a created file: 0, and its entry is durable).
    fn file_opened(&self, name: &str, len_bytes: u64);
    /// A file's size grew to `len_bytes`, zero filled, and the new size is durable.
    fn file_grown(&self, name: &str, len_bytes: u64);
    /// A write of `data` at `offset` was handed to the kernel. Returns a tag the device passes
    /// back with its completion.
    fn write_submitted(&self, name: &str, offset: u64, data: &[u8]) -> u64;
    /// The write tagged `tag` completed (`ok`: the whole buffer was transferred).
    fn write_completed(&self, tag: u64, ok: bool);
    /// An fdatasync of `name` is about to start: it covers the writes completed before now.
    fn sync_started(&self, name: &str);
    /// That fdatasync returned (`ok`: successfully).
    fn sync_finished(&self, name: &str, ok: bool);
}

/// A recording observer for the devices' unit tests.
#[cfg(test)]
pub(crate) mod testing {
    use std::sync::Mutex;

    #[derive(Clone, Debug, PartialEq, Eq)]
    pub(crate) enum Event {
        Opened(String),
        Grown(String, u64),
        Submitted { tag: u64, name: String, offset: u64 },
        Completed { tag: u64, ok: bool },
        SyncStarted(String),
        SyncFinished(String, bool),
    }

    #[derive(Default)]
    pub(crate) struct EventLog {
        pub(crate) events: Mutex<Vec<Event>>,
    }

    impl EventLog {
        pub(crate) fn events(&self) -> Vec<Event> {
            self.events.lock().unwrap().clone()
        }

        /// The tag of the first write observed to `name`.
        pub(crate) fn first_write_to(&self, name: &str) -> Option<u64> {
            self.events().iter().find_map(|event| match event {
                Event::Submitted { tag, name: to, .. } if to == name => Some(*tag),
                _ => None,
            })
        }

        /// Whether the write tagged `tag` completed and a successful fdatasync of `name`
        /// started after its completion.
        pub(crate) fn synced_after_completion(&self, tag: u64, name: &str) -> bool {
            let events = self.events();
            let Some(done) = events.iter().position(|e| *e == Event::Completed { tag, ok: true })
            else {
                return false;
            };
            let started = Event::SyncStarted(name.to_string());
            let finished = Event::SyncFinished(name.to_string(), true);
            events[done..]
                .iter()
                .position(|e| *e == started)
                .is_some_and(|at| events[done + at..].contains(&finished))
        }
    }

    impl super::IoObserver for EventLog {
        fn file_opened(&self, name: &str, _len_bytes: u64) {
            self.events.lock().unwrap().push(Event::Opened(name.to_string()));
        }
        fn file_grown(&self, name: &str, len_bytes: u64) {
            self.events.lock().unwrap().push(Event::Grown(name.to_string(), len_bytes));
        }
        fn write_submitted(&self, name: &str, offset: u64, _data: &[u8]) -> u64 {
            let mut events = self.events.lock().unwrap();
            let tag = events.len() as u64;
            events.push(Event::Submitted { tag, name: name.to_string(), offset });
            tag
        }
        fn write_completed(&self, tag: u64, ok: bool) {
            self.events.lock().unwrap().push(Event::Completed { tag, ok });
        }
        fn sync_started(&self, name: &str) {
            self.events.lock().unwrap().push(Event::SyncStarted(name.to_string()));
        }
        fn sync_finished(&self, name: &str, ok: bool) {
            self.events.lock().unwrap().push(Event::SyncFinished(name.to_string(), ok));
        }
    }
}
