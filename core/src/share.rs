//! [`Share`]: a value the copies of the state share.
//!
//! A replica keeps several copies of the state (the one apply writes, the
//! views readers read, the leader's scheduling copy). A job's script and
//! environment are most of its bytes and never change once submitted, so
//! they are held behind a reference count: cloning a job, or the whole
//! state, copies a pointer, and a 1 MiB script is kept once however many
//! copies hold it. A change through [`std::ops::DerefMut`] copies the value
//! first (copy on write), so a copy never sees another's change.
//!
//! The encoding is the value's own (serde is transparent here): every data
//! format's bytes are unchanged.

use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

#[derive(Clone, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Share<T>(Arc<T>);

impl<T> Share<T> {
    pub fn new(value: T) -> Share<T> {
        Share(Arc::new(value))
    }

    /// Whether `a` and `b` hold the very same value (not merely equal ones).
    pub fn same(a: &Share<T>, b: &Share<T>) -> bool {
        Arc::ptr_eq(&a.0, &b.0)
    }
}

impl<T: Clone> Share<T> {
    /// The value, without copying it when nothing else holds it.
    pub fn into_inner(self) -> T {
        Arc::unwrap_or_clone(self.0)
    }
}

impl<T> std::ops::Deref for Share<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T: Clone> std::ops::DerefMut for Share<T> {
    fn deref_mut(&mut self) -> &mut T {
        Arc::make_mut(&mut self.0)
    }
}

impl<T> From<T> for Share<T> {
    fn from(value: T) -> Share<T> {
        Share::new(value)
    }
}

impl From<&str> for Share<String> {
    fn from(value: &str) -> Share<String> {
        Share::new(value.to_string())
    }
}

impl<A, T: FromIterator<A>> FromIterator<A> for Share<T> {
    fn from_iter<I: IntoIterator<Item = A>>(iter: I) -> Share<T> {
        Share::new(T::from_iter(iter))
    }
}

impl<'a, T> IntoIterator for &'a Share<T>
where
    &'a T: IntoIterator,
{
    type Item = <&'a T as IntoIterator>::Item;
    type IntoIter = <&'a T as IntoIterator>::IntoIter;
    fn into_iter(self) -> Self::IntoIter {
        self.0.as_ref().into_iter()
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for Share<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl PartialEq<str> for Share<String> {
    fn eq(&self, other: &str) -> bool {
        self.0.as_str() == other
    }
}

impl PartialEq<&str> for Share<String> {
    fn eq(&self, other: &&str) -> bool {
        self.0.as_str() == *other
    }
}

impl<T: Serialize> Serialize for Share<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Share<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Share<T>, D::Error> {
        T::deserialize(d).map(Share::new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_share_encodes_as_its_value_and_copies_on_write() {
        let text = "#!/bin/sh\necho hi\n".to_string();
        let shared: Share<String> = text.clone().into();
        let cfg = bincode::config::standard();
        assert_eq!(
            bincode::serde::encode_to_vec(&shared, cfg).unwrap(),
            bincode::serde::encode_to_vec(&text, cfg).unwrap()
        );
        let back: (Share<String>, usize) =
            bincode::serde::decode_from_slice(&bincode::serde::encode_to_vec(&text, cfg).unwrap(), cfg).unwrap();
        assert_eq!(back.0, shared);
        let mut copy = shared.clone();
        assert!(Share::same(&copy, &shared), "a clone copied the value");
        copy.push_str("echo again\n");
        assert!(!Share::same(&copy, &shared));
        assert_eq!(*shared, text, "a change reached another copy");
    }
}
