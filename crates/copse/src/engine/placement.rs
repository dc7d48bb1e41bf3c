//! The vocabulary of record placement that the layers above the engine use: what a store asks
//! for (`PlacementSetting`, in `Options` and the manifest), what each size class got
//! (`Placement`, in the manifest and in stats) and the figures of an append class
//! (`AppendFigures`, in `ClassStats`). Engine-neutral: the native engine implements placement
//! (`engine/native/placement.rs`, `gc.rs`); an engine without size classes reports none.

use serde::Serialize;

/// Size classes the manifest records a placement for, by class id: every class of the native
/// engine (a multi-page class is always in place). Part of the manifest's format (one byte
/// each); the native engine asserts that its class table agrees.
pub const PLACED_CLASS_COUNT: usize = 76;

/// How a new store places records, decided when it is created (`engine::factory`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlacementDecision {
    pub setting: PlacementSetting,
    pub placements: [Placement; PLACED_CLASS_COUNT],
    pub probe_ratio_milli: u32,
}

/// How a size class places new records. persisted: never renumber.
#[repr(u8)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Placement {
    /// KVell: a new version goes to a free slot (beside its old copy when that page is cached),
    /// so pages are written at random, each with the round's changes to it.
    #[default]
    InPlace = 1,
    /// RStore: new versions are appended to the open block and written as consecutive pages;
    /// a garbage collector empties the blocks with the most dead slots.
    Append = 2,
}

impl Placement {
    pub fn from_persisted(value: u8) -> Option<Placement> {
        match value {
            1 => Some(Placement::InPlace),
            2 => Some(Placement::Append),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Placement::InPlace => "in-place",
            Placement::Append => "append",
        }
    }
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What a store asks for when it is created: a placement, or `Auto` (decided per class from a
/// device probe and the class's slot size, `choose_placement`). Recorded in the manifest.
/// persisted: never renumber.
#[repr(u8)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PlacementSetting {
    InPlace = 1,
    Append = 2,
    #[default]
    Auto = 3,
}

impl PlacementSetting {
    pub fn from_persisted(value: u8) -> Option<PlacementSetting> {
        match value {
            1 => Some(PlacementSetting::InPlace),
            2 => Some(PlacementSetting::Append),
            3 => Some(PlacementSetting::Auto),
            _ => None,
        }
    }
}

impl std::str::FromStr for PlacementSetting {
    type Err = String;
    fn from_str(text: &str) -> Result<PlacementSetting, String> {
        match text {
            "in-place" => Ok(PlacementSetting::InPlace),
            "append" => Ok(PlacementSetting::Append),
            "auto" => Ok(PlacementSetting::Auto),
            other => {
                Err(format!("unknown placement {other:?} (expected in-place, append or auto)"))
            }
        }
    }
}

impl std::fmt::Display for PlacementSetting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PlacementSetting::InPlace => "in-place",
            PlacementSetting::Append => "append",
            PlacementSetting::Auto => "auto",
        })
    }
}

/// What the collector and `copse stats` report of one append class.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct AppendFigures {
    pub blocks: u64,
    pub free_blocks: u64,
    pub used_slots: u64,
    /// Slots of sealed blocks (and the open block's handed-out part) that hold nothing live.
    pub dead_slots: u64,
    /// Blocks chosen as victims.
    pub gc_runs: u64,
    pub gc_blocks_freed: u64,
    pub gc_slots_moved: u64,
    /// Of those, records whose key was rewritten or deleted after their victim was read and
    /// before the copy was durable: written, then freed at once (`move_record` does not look a
    /// collection's put up again).
    pub gc_slots_moved_dead: u64,
    pub gc_bytes_moved: u64,
    pub gc_bytes_read: u64,
    /// Collections that ended with live slots left in the block.
    pub gc_blocked: u64,
    /// Scans whose scattered items were queued to be rewritten side by side (clustering).
    pub cluster_runs: u64,
    pub cluster_slots_moved: u64,
    pub cluster_bytes_moved: u64,
}

impl AppendFigures {
    /// Adds another shard's figures of the same class.
    pub fn merge(&mut self, other: &AppendFigures) {
        self.blocks += other.blocks;
        self.free_blocks += other.free_blocks;
        self.used_slots += other.used_slots;
        self.dead_slots += other.dead_slots;
        self.gc_runs += other.gc_runs;
        self.gc_blocks_freed += other.gc_blocks_freed;
        self.gc_slots_moved += other.gc_slots_moved;
        self.gc_slots_moved_dead += other.gc_slots_moved_dead;
        self.gc_bytes_moved += other.gc_bytes_moved;
        self.gc_bytes_read += other.gc_bytes_read;
        self.gc_blocked += other.gc_blocked;
        self.cluster_runs += other.cluster_runs;
        self.cluster_slots_moved += other.cluster_slots_moved;
        self.cluster_bytes_moved += other.cluster_bytes_moved;
    }
}
