//! Hash commands (filled in next).

use super::Spec;

pub fn specs() -> Vec<Spec> {
    vec![]
}
