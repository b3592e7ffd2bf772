//! Slurm hostlists: `gpu[001-003,7],login1` ⇄ the names one per entry.
//! The one implementation is the wire's (`gangway_proto::hostlist`): the
//! leader sends a big gang's nodes as one, the agents build
//! `SLURM_JOB_NODELIST` with it, and the commands read it.

pub use gangway_proto::hostlist::{compress, expand};
