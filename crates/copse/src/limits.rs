//! Every limit of copse, in one place (TigerBeetle's `constants.zig` is the model).
//!
//! Names carry their unit last. A limit that a user can exceed is enforced with a clear error
//! where the request enters the store (`interfaces::db`), before any allocation of that size.

/// The unit of every data I/O and of the page cache. Slab files are arrays of pages.
pub const PAGE_BYTES: usize = 4096;
/// O_DIRECT alignment of buffers, offsets and lengths. Torn writes split at this granularity.
pub const SECTOR_BYTES: usize = 512;

/// Keys are 1 B to 1 KiB, compared as byte strings.
pub const KEY_BYTES_MIN: usize = 1;
pub const KEY_BYTES_MAX: usize = 1024;
/// Values are 0 B to 16 MiB.
pub const VALUE_BYTES_MAX: usize = 16 * 1024 * 1024;

/// Shards per store: one thread each. The count is fixed at creation (recorded in the manifest).
pub const SHARDS_MAX: usize = 256;

/// Requests a shard's inbound queue holds before senders block (backpressure).
pub const SHARD_QUEUE_REQUESTS_MAX: usize = 4096;
/// Requests a shard takes from its queue in one round (p2KVS opportunistic batching: it takes
/// what is there, up to this many, and never waits to fill a batch).
pub const ROUND_REQUESTS_MAX: usize = 256;

/// Device I/Os a shard keeps in flight at most (KVell: enough for bandwidth, not so many that
/// latency grows). Configurable per store up to `IO_DEPTH_MAX`.
pub const IO_DEPTH_DEFAULT: usize = 64;
pub const IO_DEPTH_MAX: usize = 1024;

/// Page cache budget of the whole store, split evenly over shards.
pub const CACHE_BYTES_DEFAULT: usize = 256 * 1024 * 1024;
/// Each shard's cache holds at least this many pages, so a round's page images always fit.
pub const CACHE_PAGES_PER_SHARD_MIN: usize = 256;

/// Free slots a class keeps in memory; the rest are chained on disk through free records
/// (KVell §5.3 keeps 64; more in memory lets one round reuse more slots without a read).
pub const FREE_SLOTS_IN_MEMORY_MAX: usize = 4096;
/// Independent on-disk free chains per class (KVell: N stacks whose heads live in memory, so N
/// free slots can be found per round without reading tombstones in sequence).
pub const FREE_CHAINS_PER_CLASS: usize = 64;

/// Operations in one `write_batch`, and the encoded bytes of all of them. A batch is atomic at
/// any size within these: it is first recorded whole, as one record up to
/// `BATCH_RECORD_BYTES_MAX` or a chain of such records beyond (docs/format/slab.md, "Chunk
/// records"). They sit above what one Redis request can carry (`MULTIBULK_ARGS_MAX` arguments
/// of a few items each; the default query buffer limit of 256 MiB), so that an MSET or DEL the
/// server accepts is one atomic write whatever its size.
pub const WRITE_BATCH_OPS_MAX: usize = 4 * 1024 * 1024;
pub const WRITE_BATCH_BYTES_MAX: usize = 1024 * 1024 * 1024;
/// The largest value of one batch (or part) record. A batch whose encoding is larger is recorded
/// as a chain of Chunk records of at most this many bytes each (`Options::batch_record_bytes_max`
/// lowers it, for tests that want long chains from small batches).
pub const BATCH_RECORD_BYTES_MAX: usize = VALUE_BYTES_MAX;
/// The least `Options::batch_record_bytes_max` accepts: room for a chunk's header and a piece.
pub const BATCH_RECORD_BYTES_MIN: usize = 64;
/// Members of one batch written at once: the rest wait until these are durable, so the page
/// images and I/O a huge batch holds stay bounded (its members are applied together at the end
/// whatever their number). A batch within these limits is written in one go, as before chains.
pub const BATCH_MEMBERS_IN_FLIGHT_MAX: usize = 10_000;
pub const BATCH_MEMBER_BYTES_IN_FLIGHT_MAX: usize = VALUE_BYTES_MAX;
/// Records of one chain (a batch or part larger than `BATCH_RECORD_BYTES_MAX`) placed at once;
/// the next is placed as each is durable, so a chain's page images stay this many records'
/// worth (`engine/native/batch.rs`, `ChainRest`).
pub const CHAIN_RECORDS_IN_FLIGHT_MAX: usize = 2;

/// Items one `scan` call returns at most.
pub const SCAN_ITEMS_MAX: usize = 100_000;

/// Operations, and encoded bytes, of one write group's batch (`shard::exec`: the last writes of
/// execs queued on one lock key, merged): past these, an exec writes alone after the group. A
/// group is latency its members share, so it stays this small whatever one batch may hold.
pub const EXEC_WRITE_GROUP_OPS_MAX: usize = 10_000;
pub const EXEC_WRITE_GROUP_BYTES_MAX: usize = VALUE_BYTES_MAX;

/// Execs one write group takes at most (`shard::exec`: consecutive last writes on one lock key
/// made durable by one write). Bounds the work and the memory a hot key's group holds.
pub const EXEC_WRITE_GROUP_MEMBERS_MAX: usize = 4_096;

/// Background flushes (io_uring fsync) one shard has in flight at once: a write that completes
/// while one runs starts the next rather than waiting for it to end (docs/durability.md).
pub const FLUSHES_IN_FLIGHT_MAX: usize = 2;

/// While a background flush is in flight, a shard's dirty pages wait for it to end (one write
/// and one flush then carry what arrived meanwhile) until they carry this many writes; from
/// there on they go at once, so a large group still overlaps the flush (docs/durability.md,
/// "Writes held behind a flush").
pub const WRITES_HELD_BEHIND_FLUSH_MAX: usize = 64;

/// Reads one step of an exec program may ask for (MGET's keys of one shard, say).
pub const EXEC_READS_MAX: usize = 10_000;

/// Lock version counters per shard (`ExecView::lock_version`, Redis's WATCH): 512 KiB once the
/// shard's execs first write. Two locks share a counter with odds of 1 in this many, which can
/// only fail a watching transaction that would have passed.
pub const LOCK_VERSION_SLOTS: usize = 65_536;

/// Steps one sequence (`exec::Sequence`, Redis's MULTI ... EXEC) may run: each is a whole exec
/// program, so the bound is on what one shard's lock holder may do at once.
pub const SEQUENCE_STEPS_MAX: usize = 100_000;

/// Slab files grow by this fraction of their size (at least `SLAB_GROWTH_BYTES_MIN`, at most
/// `SLAB_GROWTH_BYTES_MAX`), so growth is rare and each growth is one fallocate and one
/// zero-fill.
pub const SLAB_GROWTH_BYTES_MIN: u64 = 1024 * 1024;
/// The most a slab file grows by at once. A growth writes zeros over the new space before it
/// returns (`device::files::grow_file`), on the shard's thread: 32 MiB take ~15 ms on this
/// machine's disk (docs/durability.md, "Growing a file").
pub const SLAB_GROWTH_BYTES_MAX: u64 = 32 * 1024 * 1024;
/// The buffer of zeros a growth writes from, one write of at most this many bytes at a time.
pub const GROW_ZERO_FILL_CHUNK_BYTES: usize = 4 * 1024 * 1024;
pub const SLAB_GROWTH_DIVISOR: u64 = 8;

/// Consecutive dirty pages of a file are written with one I/O of at most this many pages.
pub const WRITE_PAGES_PER_IO_MAX: usize = 64;
/// Consecutive pages a scan needs are read with one I/O of at most this many pages.
pub const READ_PAGES_PER_IO_MAX: usize = 64;

/// Append placement (engine/native/placement.rs, docs/placement.md): a class's file is cut into
/// blocks of this many pages, the unit the collector empties and reuses.
pub const APPEND_BLOCK_PAGES: u32 = 64;
/// The largest block `Options::append_block_pages` accepts (the collector reads a block whole).
pub const APPEND_BLOCK_PAGES_MAX: u32 = 4096;
/// What the collector keeps an append class's file under, in times its live slots, unless told
/// otherwise (`Options::space_amplification_max`), and the range accepted.
pub const SPACE_AMPLIFICATION_DEFAULT: f64 = 1.5;
pub const SPACE_AMPLIFICATION_MIN: f64 = 1.1;
pub const SPACE_AMPLIFICATION_MAX: f64 = 16.0;
/// Moves the collector issues per round: at least the minimum, plus this many per slot the
/// round appended (so it keeps up with the writes that use space), never more than the maximum
/// (so a round's foreground requests never wait behind a whole block).
pub const GC_MOVES_PER_ROUND_MIN: usize = 64;
pub const GC_MOVES_PER_APPENDED_SLOT: usize = 4;
pub const GC_MOVES_PER_ROUND_MAX: usize = 1024;
/// Blocks one collection empties together at most; it takes enough to free this many times
/// what the round that started it appended.
pub const GC_VICTIMS_PER_RUN_MAX: usize = 64;
/// Victim read buffers (one block each) a shard's collector keeps for its next collections, so
/// a collection does not allocate and zero a block's worth of memory per victim (4% of the
/// server's CPU under overwrites, docs/benchmarks.md). At 64-page blocks: 1 MiB per shard.
pub const GC_READ_BUFFERS_KEPT: usize = 4;
pub const GC_FREE_PER_APPENDED: u64 = 6;
/// The collector starts this far into the room between live data and the space ceiling (so
/// that a burst of writes meets a collection already under way).
pub const GC_START_FRACTION_OF_CEILING_ROOM: f64 = 0.8;
/// The least room, in blocks, an append class keeps besides its live slots before the collector
/// starts, whatever the ceiling. A class whose live data fills only a few blocks otherwise
/// stands past the start for good and the collector churns its live records round after round
/// (24 moves per SET with 256 live 1 KiB records per shard); and in a class of a dozen blocks,
/// the deadest block is barely deader than the others when a tight start comes (2,048 live
/// records per shard: 2.4 moves per SET with 3 blocks of room, 0.8 with 6, for 768 KiB more
/// file per class and shard at most; docs/benchmarks.md, 2026-11-27).
pub const GC_ROOM_BLOCKS_MIN: u64 = 6;

/// Clustering (engine/native/cluster.rs, docs/placement.md): a scan's items of one append class
/// are rewritten side by side when there are at least `CLUSTER_ITEMS_MIN` of them and they lay
/// on more than `CLUSTER_SCATTER_MAX` times the pages they fill side by side. At most
/// `CLUSTER_QUEUED_BYTES_MAX` bytes of queued moves wait per shard (a scan that would pass it is
/// not clustered), and at most `CLUSTER_MOVES_PER_ROUND_MAX` moves start per round (a longer scan
/// is clustered in its first that many items).
pub const CLUSTER_ITEMS_MIN: usize = 8;
pub const CLUSTER_SCATTER_MAX: usize = 2;
pub const CLUSTER_QUEUED_BYTES_MAX: usize = 4 * 1024 * 1024;
pub const CLUSTER_MOVES_PER_ROUND_MAX: usize = 512;

/// The write probe behind `auto` placement (device/probe.rs): its scratch file, how long each
/// phase writes, random pages per batch, and the size of a sequential write.
pub const PROBE_FILE_BYTES: u64 = 16 * 1024 * 1024;
pub const PROBE_PHASE_MS: u64 = 60;
pub const PROBE_RANDOM_DEPTH: usize = 32;
pub const PROBE_SEQUENTIAL_IO_BYTES: usize = 256 * 1024;

/// Recovery reads slabs in chunks of this size, this many at a time (sequential bandwidth).
pub const RECOVERY_CHUNK_BYTES: usize = 1024 * 1024;
pub const RECOVERY_CHUNKS_IN_FLIGHT: usize = 4;

/// An online scrub keeps at most this many reads in flight per shard, leaving the rest of the
/// queue depth to foreground requests.
pub const SCRUB_READS_IN_FLIGHT_MAX: usize = 4;
/// The scrub's item pass takes this many index entries at a time.
pub const SCRUB_ITEMS_PER_STEP_MAX: usize = 256;

/// The RocksDB engine (`engine/rocks`): data block size (one page, as the native engine reads),
/// bloom filter bits per key, and how `settle` waits for background work.
pub const ROCKSDB_BLOCK_BYTES: usize = 4096;
pub const ROCKSDB_BLOOM_BITS_PER_KEY: f64 = 10.0;
/// Memtable bytes of one RocksDB instance: the cache budget over this, over the shard count (two
/// memtables per instance: a quarter of the budget in all).
pub const ROCKSDB_MEMTABLE_BUDGET_DIVISOR: usize = 8;
pub const ROCKSDB_SETTLE_POLL_MS: u64 = 50;
pub const ROCKSDB_SETTLE_SECONDS_MAX: u64 = 600;

/// Attempts a multi-key read (`Db::multi_get`, scans, MGET) makes while cross-shard batches keep
/// deciding during it, before it makes new batches wait until it is done (router/txn.rs).
pub const MULTI_READ_ATTEMPTS_BEFORE_EXCLUSIVE: usize = 4;
