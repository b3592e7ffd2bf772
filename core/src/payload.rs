//! A Raft log entry's payload: a command and the data format it is encoded
//! in (see [`crate::format`] for the formats and how a cluster moves between
//! them), and which format each command needs. Kept apart from the format
//! constants, which every module reads, so that those depend on nothing.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::command::Command;
use crate::compat::{v10, v11, v12, v4, v5, v8};
use crate::format::*;
use crate::policy::PreemptMode;

/// A Raft log entry's payload: a command and the format it is (to be) encoded in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Payload {
    pub format: u32,
    /// None: the entry is in a format newer than this build reads. Applying it
    /// is impossible; the replica must stop and say so.
    pub command: Option<Command>,
    /// An unreadable entry's bytes, kept so the entry is stored (and sent on)
    /// exactly as received until the replica stops at it.
    pub unread: Vec<u8>,
}

impl Payload {
    /// `command` to be written in `cluster_format`, or in the format that
    /// introduced the command when that is newer (only [`Command::SetDataFormat`]).
    pub fn new(command: Command, cluster_format: u32) -> Payload {
        Payload { format: cluster_format.max(command.since_format()), command: Some(command), unread: Vec::new() }
    }
}

impl Command {
    /// The first data format that can carry this command.
    pub fn since_format(&self) -> u32 {
        match self {
            // Written in the format it moves to: a build that cannot read
            // that format stops at this entry instead of applying it.
            Command::SetDataFormat { format, .. } => (*format).max(5),
            Command::Batch(cmds) => cmds.iter().map(Command::since_format).max().unwrap_or(FORMAT_BASE),
            // Roles, the user map and the job switches came with format 6.
            Command::UpdatePolicy { policy, .. } => policy.needs_format(),
            Command::ApplySchedule { preemptions, .. }
                if preemptions.iter().any(|p| p.mode == PreemptMode::Suspend) =>
            {
                PREEMPT_SUSPEND_FORMAT
            }
            Command::SetNodeState {
                change: crate::command::NodeStateChange::PowerDown | crate::command::NodeStateChange::PowerUp,
                ..
            } => ELASTIC_POOLS_FORMAT,
            Command::SubmitJob { spec, .. } if !spec.components.is_empty() => HET_JOBS_FORMAT,
            Command::SubmitJob { spec, .. } if spec.format_9_field().is_some() => SLURM_FEATURES_FORMAT,
            Command::ChangeReservation { .. } => SLURM_FEATURES_FORMAT,
            Command::JobFinished { state: crate::model::JobState::Deadline, .. } => SLURM_FEATURES_FORMAT,
            Command::UpdateJob {
                change:
                    crate::command::JobChange::Suspend
                    | crate::command::JobChange::Resume
                    | crate::command::JobChange::Signal { .. },
                ..
            } => SUSPEND_FORMAT,
            Command::StepStarted { .. } | Command::StepEnded { .. } => SUSPEND_FORMAT,
            Command::TaskExited { usage: Some(_), .. }
            | Command::RestoreUsage { .. }
            | Command::AccountingStored { .. } => ACCOUNTING_FORMAT,
            Command::DrawHistory { .. } => FRESH_HISTORY_FORMAT,
            Command::SetNodeInventory { .. } => NODE_ADMISSION_FORMAT,
            _ => FORMAT_BASE,
        }
    }
}

impl Command {
    /// Whether this command may be proposed while the cluster is at
    /// `cluster_format`: every command in it (a batch's in order) must be
    /// carried by the format in effect when it applies. Only
    /// [`Command::SetDataFormat`] may be newer: it moves the format. A
    /// command written in a newer format would stop the replicas that cannot
    /// read it, so the leader refuses it instead. Returns the format in
    /// effect after the command.
    pub fn writable_in(&self, cluster_format: u32) -> Result<u32, String> {
        match self {
            Command::SetDataFormat { format, .. } => Ok(cluster_format.max(*format)),
            Command::Batch(cmds) => cmds.iter().try_fold(cluster_format, |f, c| c.writable_in(f)),
            c if c.since_format() > cluster_format => Err(format!(
                "{} needs data format {}; this cluster is on format {cluster_format} until every replica runs a \
                 build that reads it",
                c.name(),
                c.since_format()
            )),
            _ => Ok(cluster_format),
        }
    }
}

impl Serialize for Payload {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::Error;
        let Some(command) = &self.command else {
            return v4::Wire::Envelope { format: self.format, body: self.unread.clone() }.serialize(serializer);
        };
        // From format 9 on, a format's variants are today's: one a command
        // of a later format uses must not be written in an earlier one.
        if self.format >= SLURM_FEATURES_FORMAT && command.since_format() > self.format {
            return Err(S::Error::custom(format!(
                "{} needs data format {}, not {}",
                command.name(),
                command.since_format(),
                self.format
            )));
        }
        match self.format {
            4 => v4::Wire::from_command(command).map_err(S::Error::custom)?.serialize(serializer),
            5 => {
                let body = to_bytes(&v5::Wire::from_command(command).map_err(S::Error::custom)?);
                v4::Wire::Envelope { format: 5, body }.serialize(serializer)
            }
            // Formats 7 and 8 changed rules of apply, not the command's encoding.
            format @ (6..=8) => {
                let body = to_bytes(&v8::Wire::from_command(command).map_err(S::Error::custom)?);
                v4::Wire::Envelope { format, body }.serialize(serializer)
            }
            // Format 10 appended variants, not changing format 9's encoding.
            format @ (9 | 10) => {
                let body = to_bytes(&v10::Wire::from_command(command).map_err(S::Error::custom)?);
                v4::Wire::Envelope { format, body }.serialize(serializer)
            }
            11 => {
                let body = to_bytes(&v11::Wire::from_command(command).map_err(S::Error::custom)?);
                v4::Wire::Envelope { format: 11, body }.serialize(serializer)
            }
            12 => {
                let body = to_bytes(&v12::Wire::from_command(command).map_err(S::Error::custom)?);
                v4::Wire::Envelope { format: 12, body }.serialize(serializer)
            }
            // Formats 14, 15 and 18 changed rules of apply, 16 and 17
            // appended a variant: none changed the command's encoding.
            format @ (13..=18) => v4::Wire::Envelope { format, body: to_bytes(command) }.serialize(serializer),
            f => Err(S::Error::custom(format!("this build does not write data format {f}"))),
        }
    }
}

impl<'de> Deserialize<'de> for Payload {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        match v4::Wire::deserialize(deserializer)? {
            v4::Wire::Envelope { format: 5, body } => {
                let wire: v5::Wire = from_bytes(&body).map_err(D::Error::custom)?;
                let command = wire.into_command().ok_or_else(|| D::Error::custom("an envelope inside a batch"))?;
                Ok(Payload { format: 5, command: Some(command), unread: Vec::new() })
            }
            v4::Wire::Envelope { format: format @ (6..=8), body } => {
                let wire: v8::Wire = from_bytes(&body).map_err(D::Error::custom)?;
                let command = wire.into_command().ok_or_else(|| D::Error::custom("an envelope inside a batch"))?;
                Ok(Payload { format, command: Some(command), unread: Vec::new() })
            }
            v4::Wire::Envelope { format: format @ (9 | 10), body } => {
                let wire: v10::Wire = from_bytes(&body).map_err(D::Error::custom)?;
                let command = wire.into_command().ok_or_else(|| D::Error::custom("an envelope inside a batch"))?;
                Ok(Payload { format, command: Some(command), unread: Vec::new() })
            }
            v4::Wire::Envelope { format: 11, body } => {
                let wire: v11::Wire = from_bytes(&body).map_err(D::Error::custom)?;
                let command = wire.into_command().ok_or_else(|| D::Error::custom("an envelope inside a batch"))?;
                Ok(Payload { format: 11, command: Some(command), unread: Vec::new() })
            }
            v4::Wire::Envelope { format: 12, body } => {
                let wire: v12::Wire = from_bytes(&body).map_err(D::Error::custom)?;
                let command = wire.into_command().ok_or_else(|| D::Error::custom("an envelope inside a batch"))?;
                Ok(Payload { format: 12, command: Some(command), unread: Vec::new() })
            }
            v4::Wire::Envelope { format: format @ (13..=18), body } => {
                let command = from_bytes(&body).map_err(D::Error::custom)?;
                Ok(Payload { format, command: Some(command), unread: Vec::new() })
            }
            v4::Wire::Envelope { format, body } if format > FORMAT_NEWEST => {
                Ok(Payload { format, command: None, unread: body })
            }
            v4::Wire::Envelope { format, .. } => {
                Err(D::Error::custom(format!("an envelope cannot carry data format {format}")))
            }
            bare => {
                let command = bare.into_command().ok_or_else(|| D::Error::custom("an envelope inside a batch"))?;
                Ok(Payload { format: 4, command: Some(command), unread: Vec::new() })
            }
        }
    }
}
