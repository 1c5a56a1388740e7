//! Shared folders: how a host folder appears in a session's guest and how its contents get back.
//!
//! [`paths`] translates between guest paths (`/sessions/<session>/mnt/<folder>/…`) and host paths
//! and opens guest-named files on the host without leaving the share; [`shadow`] is the host side
//! of shadow mode (baseline, conflict-checked apply, export); [`folders`] shares folders with a
//! running VM (host bind through its folder server, then the guest mount). `beneath` holds the
//! fd-relative syscalls both rely on, so the `unsafe` lives in one place; [`tree`] walks and
//! copies the trees a guest writes (a session's outputs and uploads) by them, never following
//! a symlink, within bounds.

pub(crate) mod beneath;
pub mod folders;
pub mod paths;
pub mod shadow;
pub mod tree;

pub use folders::{FolderPins, FolderPolicy, ShareError, Shared, SharedFolders};
