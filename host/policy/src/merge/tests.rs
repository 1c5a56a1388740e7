use std::path::PathBuf;

use crate::network::{NetworkMode, NetworkPolicy};
use proptest::prelude::*;

use super::*;
use crate::policy::PolicyType;

fn net(mode: NetworkMode, domains: &[&str]) -> NetworkPolicy {
    NetworkPolicy { mode, allow_domains: domains.iter().map(|d| d.to_string()).collect(), ..Default::default() }
}

fn paths(v: &[&str]) -> Option<Vec<PathBuf>> {
    Some(v.iter().map(PathBuf::from).collect())
}

/// Seed 003's level function (`gDs`) has no case for `WORKSPACE_READONLY`, so a read-only
/// request ranks as unsandboxed and loses to a read-write user policy. Here read-only is the
/// most restrictive type and wins from either side.
#[test]
fn regression_workspace_readonly_is_the_most_restrictive_type() {
    let readonly = SandboxPolicy { kind: Some(PolicyType::WorkspaceReadonly), ..Default::default() };
    for other in [PolicyType::WorkspaceReadwrite, PolicyType::InsecureNone, PolicyType::WorkspaceReadonly] {
        let other = SandboxPolicy { kind: Some(other), ..Default::default() };
        assert_eq!(merge(&readonly, &other).kind, Some(PolicyType::WorkspaceReadonly));
        assert_eq!(merge(&other, &readonly).kind, Some(PolicyType::WorkspaceReadonly));
    }
    // Also with the network Cursor's levels mix in: read-write without network does not beat
    // read-only with network on the type.
    let rw_no_net = SandboxPolicy {
        kind: Some(PolicyType::WorkspaceReadwrite),
        network: Some(net(NetworkMode::None, &[])),
        ..Default::default()
    };
    let ro_net = SandboxPolicy {
        kind: Some(PolicyType::WorkspaceReadonly),
        network: Some(net(NetworkMode::Any, &[])),
        ..Default::default()
    };
    let m = merge(&rw_no_net, &ro_net);
    assert_eq!(m.kind, Some(PolicyType::WorkspaceReadonly));
    assert_eq!(m.network.unwrap().mode, NetworkMode::None);
}

/// The seeds' merge order: admin, user, session and command sources, each field decided by
/// the most restrictive, and the result names the deciders.
#[test]
fn merge_order_table() {
    let admin = SandboxPolicy {
        block_git_writes: Some(true),
        network: Some(net(NetworkMode::Allowlist, &["*.pypi.org", "pypi.org", "github.com"])),
        ..Default::default()
    };
    let user = SandboxPolicy {
        kind: Some(PolicyType::WorkspaceReadwrite),
        block_git_writes: Some(false),
        network: Some(net(NetworkMode::Any, &[])),
        ignore: Some(vec![".env".into()]),
        ..Default::default()
    };
    let session = SandboxPolicy {
        kind: Some(PolicyType::WorkspaceReadwrite),
        additional_readwrite_paths: paths(&["/home/me/.cargo"]),
        additional_readonly_paths: paths(&["/opt/sdk"]),
        ignore: Some(vec!["*.pem".into(), ".env".into()]),
        ..Default::default()
    };
    let command = SandboxPolicy {
        kind: Some(PolicyType::WorkspaceReadonly),
        network: Some(net(NetworkMode::Allowlist, &["files.pypi.org", "example.com"])),
        disable_tmp_write: Some(false),
        ..Default::default()
    };
    let merged = merge_sources(&[
        (PolicySource::Command, command),
        (PolicySource::Session, session),
        (PolicySource::User, user),
        (PolicySource::Admin, admin),
    ]);
    let p = &merged.policy;
    assert_eq!(p.kind, Some(PolicyType::WorkspaceReadonly));
    assert_eq!(p.block_git_writes, Some(true), "the admin's block survives the user's false");
    assert_eq!(p.disable_tmp_write, Some(false));
    let network = p.network.as_ref().unwrap();
    assert_eq!(network.mode, NetworkMode::Allowlist);
    assert_eq!(network.allow_domains, vec!["files.pypi.org"], "only what both allowlists allow");
    assert_eq!(p.additional_readwrite_paths, paths(&["/home/me/.cargo"]));
    assert_eq!(p.additional_readonly_paths, paths(&["/opt/sdk"]));
    assert_eq!(p.ignore, Some(vec!["*.pem".to_string(), ".env".to_string()]));

    let d = &merged.decided_by;
    assert_eq!(d.kind, vec![PolicySource::Command]);
    assert_eq!(d.block_git_writes, vec![PolicySource::Admin]);
    assert_eq!(d.network, vec![PolicySource::Admin, PolicySource::Command]);
    assert_eq!(d.paths, vec![PolicySource::Session]);
    assert_eq!(d.disable_tmp_write, vec![PolicySource::Command]);
    assert_eq!(d.ignore, vec![PolicySource::User, PolicySource::Session]);

    let effective = p.effective();
    assert_eq!(effective.kind, PolicyType::WorkspaceReadonly);
    assert!(effective.block_git_writes && !effective.disable_tmp_write);
}

#[test]
fn unset_fields_keep_their_defaults_and_say_so() {
    let merged = merge_sources(&[(PolicySource::User, SandboxPolicy::default())]);
    assert_eq!(merged.decided_by, DecidedBy::default());
    let e = merged.policy.effective();
    assert_eq!(e.kind, PolicyType::WorkspaceReadwrite);
    assert_eq!(e.network.mode, NetworkMode::None);
    assert!(!e.block_git_writes && !e.disable_tmp_write && e.ignore.is_empty());
}

#[test]
fn paths_merge_to_the_lower_access_path_by_path() {
    let a = SandboxPolicy { additional_readwrite_paths: paths(&["/data", "/cache"]), ..Default::default() };
    let b = SandboxPolicy {
        additional_readwrite_paths: paths(&["/data/out"]),
        additional_readonly_paths: paths(&["/data", "/cache"]),
        ..Default::default()
    };
    let m = merge(&a, &b);
    assert_eq!(m.additional_readwrite_paths, paths(&["/data/out"]));
    assert_eq!(m.additional_readonly_paths, paths(&["/cache", "/data"]));
    // A source that lists no paths allows none; a source that does not mention them allows all.
    let none = SandboxPolicy { additional_readwrite_paths: Some(vec![]), ..Default::default() };
    assert_eq!(merge(&a, &none).additional_readwrite_paths, Some(vec![]));
    assert_eq!(merge(&a, &SandboxPolicy::default()).additional_readwrite_paths, paths(&["/cache", "/data"]));
}

#[test]
fn json_uses_the_documented_field_names() {
    let p: SandboxPolicy =
        serde_json::from_str(r#"{"type": "workspace_readwrite", "block_git_writes": true, "ignore": [".env"]}"#)
            .unwrap();
    assert_eq!(p.kind, Some(PolicyType::WorkspaceReadwrite));
    assert_eq!(p.block_git_writes, Some(true));
    p.validate().unwrap();
    let p: SandboxPolicy = serde_json::from_str(
        r#"{"type": "workspace_readonly", "network": {"mode": "allowlist", "allow_domains": ["pypi.org"]},
            "additional_readwrite_paths": ["/home/me/.npm"], "additional_readonly_paths": ["/opt"],
            "disable_tmp_write": true}"#,
    )
    .unwrap();
    p.validate().unwrap();
    assert!(serde_json::from_str::<SandboxPolicy>(r#"{"typ": "workspace_readonly"}"#).is_err(), "typos are refused");
    assert!(serde_json::from_str::<SandboxPolicy>(r#"{"type": "readonly"}"#).is_err());
}

#[test]
fn validation_names_the_field_and_value() {
    let bad = [
        (SandboxPolicy { additional_readwrite_paths: paths(&["cache"]), ..Default::default() }, "cache"),
        (SandboxPolicy { additional_readonly_paths: paths(&["/a/../etc"]), ..Default::default() }, "/a/../etc"),
        (SandboxPolicy { ignore: Some(vec!["x[z-a]".into()]), ..Default::default() }, "x[z-a]"),
        (
            SandboxPolicy { network: Some(net(NetworkMode::Allowlist, &["bad domain"])), ..Default::default() },
            "bad domain",
        ),
    ];
    for (policy, needle) in bad {
        let err = policy.validate().unwrap_err().to_string();
        assert!(err.contains(needle), "{err}");
    }
}

fn arb_policy() -> impl Strategy<Value = SandboxPolicy> {
    let kind = prop::option::of(prop_oneof![
        Just(PolicyType::WorkspaceReadonly),
        Just(PolicyType::WorkspaceReadwrite),
        Just(PolicyType::InsecureNone),
    ]);
    let domain = prop_oneof![
        Just("example.com"),
        Just("*.example.com"),
        Just("api.example.com"),
        Just("*.api.example.com"),
        Just("pypi.org"),
        Just("*.org"),
        Just("files.pypi.org"),
    ]
    .prop_map(String::from);
    let cidr = prop_oneof![Just("10.0.0.0/8"), Just("10.1.0.0/16"), Just("10.1.2.3/32"), Just("192.168.0.0/16")]
        .prop_map(String::from);
    let mode = prop_oneof![Just(NetworkMode::None), Just(NetworkMode::Allowlist), Just(NetworkMode::Any)];
    let network =
        prop::option::of((mode, prop::collection::vec(domain, 0..4), prop::collection::vec(cidr, 0..3)).prop_map(
            |(mode, allow_domains, allow_cidrs)| NetworkPolicy {
                mode,
                allow_domains,
                allow_cidrs,
                ..Default::default()
            },
        ));
    let path = prop_oneof![Just("/a"), Just("/a/b"), Just("/a/b/c"), Just("/a/d"), Just("/e"), Just("/")]
        .prop_map(PathBuf::from);
    let path_list = prop::option::of(prop::collection::vec(path, 0..4));
    let ignore = prop::option::of(prop::collection::vec(
        prop_oneof![Just(".env"), Just("*.pem"), Just("secrets/**")].prop_map(String::from),
        0..3,
    ));
    (
        kind,
        network,
        path_list.clone(),
        path_list,
        prop::option::of(any::<bool>()),
        prop::option::of(any::<bool>()),
        ignore,
    )
        .prop_map(|(kind, network, rw, ro, git, tmp, ignore)| SandboxPolicy {
            kind,
            network,
            additional_readwrite_paths: rw,
            additional_readonly_paths: ro,
            block_git_writes: git,
            disable_tmp_write: tmp,
            ignore,
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn merge_is_commutative(a in arb_policy(), b in arb_policy()) {
        prop_assert_eq!(merge(&a, &b), merge(&b, &a));
    }

    #[test]
    fn merge_is_associative(a in arb_policy(), b in arb_policy(), c in arb_policy()) {
        prop_assert_eq!(merge(&merge(&a, &b), &c), merge(&a, &merge(&b, &c)));
    }

    #[test]
    fn merge_is_never_less_restrictive_than_an_input(a in arb_policy(), b in arb_policy()) {
        let m = merge(&a, &b);
        prop_assert!(at_least_as_restrictive(&m, &a), "{:?} vs {:?}", m, a);
        prop_assert!(at_least_as_restrictive(&m, &b), "{:?} vs {:?}", m, b);
    }

    #[test]
    fn merge_is_idempotent_and_the_empty_policy_is_its_identity(a in arb_policy()) {
        let canonical = merge(&a, &SandboxPolicy::default());
        prop_assert_eq!(merge(&canonical, &canonical), canonical.clone());
        prop_assert!(at_least_as_restrictive(&canonical, &a) && at_least_as_restrictive(&a, &canonical));
    }

    #[test]
    fn merge_sources_does_not_depend_on_their_order(a in arb_policy(), b in arb_policy(), c in arb_policy()) {
        let one = merge_sources(&[(PolicySource::Admin, a.clone()), (PolicySource::User, b.clone()), (PolicySource::Command, c.clone())]);
        let two = merge_sources(&[(PolicySource::Command, c), (PolicySource::Admin, a), (PolicySource::User, b)]);
        prop_assert_eq!(one, two);
    }
}
