//! The types of earlier data formats, frozen as they were encoded, with their
//! conversions to and from today's. One module per format still read (see
//! [`crate::format`]); a format's module goes when no supported store or
//! cluster can hold it any more.

pub mod v10;
pub mod v11;
pub mod v12;
pub mod v4;
pub mod v5;
pub mod v8;
pub mod v9;

/// A frozen type's conversion from and to today's type `T`. Every type is
/// its own frozen form; a type a later format changed has a frozen copy with
/// its own impl. Freezing is lossy for the fields a later format added: the
/// leader never writes a command that sets them in an older format
/// (`Command::writable_in`), and `apply` never sets them there.
pub trait Frozen<T>: Sized {
    fn freeze(today: T) -> Self;
    fn thaw(self) -> T;
}

impl<T> Frozen<T> for T {
    fn freeze(today: T) -> T {
        today
    }
    fn thaw(self) -> T {
        self
    }
}

/// A shared value (`crate::Share`) was a plain one in the older formats
/// (the encoding is the same).
impl<T: Clone> Frozen<crate::Share<T>> for T {
    fn freeze(today: crate::Share<T>) -> T {
        today.into_inner()
    }
    fn thaw(self) -> crate::Share<T> {
        crate::Share::new(self)
    }
}

/// Declares a frozen struct's conversions from and to today's: `$fields` are
/// the frozen type's, each converted with [`Frozen`]; today's later fields
/// take their defaults, or the values `later` gives (a state or entry of the
/// old format never sets them, as `apply` and the leader refuse to there).
macro_rules! frozen_struct {
    ($frozen:ty => $today:path { $($f:ident),* $(,)? }) => {
        frozen_struct!($frozen => $today { $($f),* } later { ..Default::default() });
    };
    ($frozen:ty => $today:path { $($f:ident),* $(,)? } later { $($later:tt)* }) => {
        impl Frozen<$today> for $frozen {
            fn freeze(t: $today) -> Self {
                Self { $($f: Frozen::freeze(t.$f),)* }
            }
            fn thaw(self) -> $today {
                $today { $($f: Frozen::thaw(self.$f),)* $($later)* }
            }
        }
    };
}

/// Declares the conversions of a map of frozen jobs `$job` and `JobsRef`,
/// which serializes today's jobs as `$job` one at a time, so writing an
/// old-format snapshot never copies the whole state.
macro_rules! frozen_jobs {
    ($job:ident, $formats:literal) => {
        impl Frozen<BTreeMap<JobId, crate::model::Job>> for BTreeMap<JobId, $job> {
            fn freeze(t: BTreeMap<JobId, crate::model::Job>) -> Self {
                t.into_iter().map(|(id, j)| (id, Frozen::freeze(j))).collect()
            }
            fn thaw(self) -> BTreeMap<JobId, crate::model::Job> {
                self.into_iter().map(|(id, j)| (id, Frozen::thaw(j))).collect()
            }
        }

        #[doc = concat!("Today's jobs, serialized as ", $formats, " encoded them.")]
        pub struct JobsRef<'a>(pub &'a BTreeMap<JobId, crate::model::Job>);

        impl serde::Serialize for JobsRef<'_> {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_map(self.0.iter().map(|(id, j)| (id, <$job as Frozen<crate::model::Job>>::freeze(j.clone()))))
            }
        }
    };
}

/// Declares a frozen format's command enum, variant for variant as `Command`
/// had them in that format (a variant's position is its encoding), with the
/// conversions to and from today's:
///
/// - `before_batch`, then `Batch` (a tuple variant holding the format's own
///   commands), then `before_policy`, then `UpdatePolicy` (holding the
///   format's own policy type), then `after_policy`;
/// - `extra`: variants past the format's commands that are not commands
///   (format 4's envelope); they never convert to a command.
///
/// Fields convert with [`Frozen`]: a field whose type a later format changed
/// is declared with its frozen copy (format 8's job spec in `SubmitJob`). A
/// `before_policy` variant to which a later format added fields gives them
/// with `later { field: value }` (they are never set in this format: the
/// leader refuses to write such a command in it).
macro_rules! frozen_commands {
    (
        format: $format:literal,
        policy: $policy:ty,
        before_batch: [$($a:ident { $($af:ident : $at:ty),* $(,)? }),* $(,)?],
        before_policy: [$($b:ident { $($bf:ident : $bt:ty),* $(,)? } $(later { $($bl:ident : $blv:expr),* })?),* $(,)?],
        after_policy: [$($c:ident { $($cf:ident : $ct:ty),* $(,)? }),* $(,)?],
        extra: [$($x:ident { $($(#[$xa:meta])* $xf:ident : $xt:ty),* $(,)? }),* $(,)?] $(,)?
    ) => {
        #[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
        pub enum Wire {
            $($a { $($af: $at),* },)*
            Batch(#[serde(deserialize_with = "crate::command::batch_items")] Vec<Wire>),
            $($b { $($bf: $bt),* },)*
            UpdatePolicy {
                policy: $policy,
                expected_version: Option<u64>,
                force: bool,
                identity: String,
                now_ms: u64,
            },
            $($c { $($cf: $ct),* },)*
            $($x { $($(#[$xa])* $xf: $xt),* },)*
        }

        impl Wire {
            /// `c` as this format writes it, or why it cannot be.
            pub fn from_command(c: &crate::command::Command) -> Result<Wire, String> {
                use crate::command::Command;
                // Freezing drops what later formats added: never for a
                // command this format cannot carry.
                if c.since_format() > $format {
                    return Err(format!("{} needs data format {}, not {}", c.name(), c.since_format(), $format));
                }
                Ok(match c.clone() {
                    $(Command::$a { $($af),* } => Wire::$a { $($af: super::Frozen::freeze($af)),* },)*
                    $(Command::$b { $($bf,)* .. } => Wire::$b { $($bf: super::Frozen::freeze($bf)),* },)*
                    $(Command::$c { $($cf),* } => Wire::$c { $($cf: super::Frozen::freeze($cf)),* },)*
                    Command::UpdatePolicy { policy, expected_version, force, identity, now_ms } => Wire::UpdatePolicy {
                        policy: <$policy>::try_from(policy)?,
                        expected_version,
                        force,
                        identity,
                        now_ms,
                    },
                    Command::Batch(cmds) => {
                        Wire::Batch(cmds.iter().map(Wire::from_command).collect::<Result<Vec<_>, String>>()?)
                    }
                    #[allow(unreachable_patterns)]
                    other => {
                        return Err(format!("{} cannot be written in data format {}", other.name(), $format))
                    }
                })
            }

            /// The command this entry holds; None for what is not a command
            /// (`extra` variants, also inside a batch).
            pub fn into_command(self) -> Option<crate::command::Command> {
                use crate::command::Command;
                Some(match self {
                    $(Wire::$a { $($af),* } => Command::$a { $($af: super::Frozen::thaw($af)),* },)*
                    $(Wire::$b { $($bf),* } => Command::$b { $($bf: super::Frozen::thaw($bf),)* $($($bl: $blv,)*)? },)*
                    $(Wire::$c { $($cf),* } => Command::$c { $($cf: super::Frozen::thaw($cf)),* },)*
                    Wire::UpdatePolicy { policy, expected_version, force, identity, now_ms } => {
                        Command::UpdatePolicy { policy: policy.into(), expected_version, force, identity, now_ms }
                    }
                    Wire::Batch(ws) => Command::Batch(ws.into_iter().map(Wire::into_command).collect::<Option<Vec<_>>>()?),
                    $(Wire::$x { .. } => return None,)*
                })
            }
        }
    };
}

/// Declares a frozen format's state: today's fields in the format's order,
/// with the policy in the format's own type. A field whose type a later
/// format changed is declared with its frozen copy and, after `=>`, the
/// wrapper that serializes today's value as that copy (`JobsRef`). Fields
/// convert with [`Frozen`]. `stored_format`: the state carried its format
/// (from format 5; the snapshot's header says the same, and the decoded
/// state takes it), followed by the `after_format` fields (from format 9).
macro_rules! frozen_state {
    (
        format: $format:literal,
        policy: $policy:ty,
        before_policy: [$($f:ident : $t:ty $(=> $fr:ident)?),* $(,)?],
        after_policy: [$($g:ident : $u:ty),* $(,)?]
        $(, stored_format: $sf:ident)?
        $(, after_format: [$($h:ident : $w:ty),* $(,)?])? $(,)?
    ) => {
        /// The state as this format encodes it (for decoding).
        #[derive(serde::Deserialize)]
        pub struct State {
            $($f: $t,)*
            policy: $policy,
            $($g: $u,)*
            $($sf: u32,)?
            $($($h: $w,)*)?
        }

        $(
            impl State {
                /// The format the state says it is in (its header must agree).
                pub fn stored_format(&self) -> u32 {
                    self.$sf
                }
            }
        )?

        /// The state as this format encodes it, borrowed from today's (the
        /// policy converted: fields of later formats are always empty in a
        /// state of this format, as `apply` refuses to set them there).
        #[derive(serde::Serialize)]
        pub struct StateRef<'a> {
            $($f: $crate::compat::frozen_ref_type!('a, $t $(, $fr)?),)*
            policy: $policy,
            $($g: &'a $u,)*
            $($sf: &'a u32,)?
            $($($h: &'a $w,)*)?
        }

        impl<'a> From<&'a crate::State> for StateRef<'a> {
            fn from(s: &'a crate::State) -> Self {
                StateRef {
                    $($f: $crate::compat::frozen_ref_value!(&s.$f $(, $fr)?),)*
                    policy: <$policy>::from(&s.policy),
                    $($g: &s.$g,)*
                    $($sf: &s.$sf,)?
                    $($($h: &s.$h,)*)?
                }
            }
        }

        impl From<State> for crate::State {
            fn from(s: State) -> Self {
                #[allow(unused_variables)]
                let format: u32 = $format;
                $(let format = s.$sf;)?
                crate::State {
                    $($f: super::Frozen::thaw(s.$f),)*
                    policy: s.policy.into(),
                    $($g: super::Frozen::thaw(s.$g),)*
                    $($($h: super::Frozen::thaw(s.$h),)*)?
                    format,
                    ..crate::State::default()
                }
            }
        }
    };
}

/// A frozen state field's type in `StateRef`: a borrow of today's value, or
/// the wrapper that serializes it as the frozen type.
macro_rules! frozen_ref_type {
    ($l:lifetime, $t:ty) => { &$l $t };
    ($l:lifetime, $t:ty, $wrapper:ident) => { $wrapper<$l> };
}

/// A frozen state field's value in `StateRef` (see `frozen_ref_type`).
macro_rules! frozen_ref_value {
    ($v:expr) => {
        $v
    };
    ($v:expr, $wrapper:ident) => {
        $wrapper($v)
    };
}

pub(crate) use {frozen_commands, frozen_jobs, frozen_ref_type, frozen_ref_value, frozen_state, frozen_struct};
