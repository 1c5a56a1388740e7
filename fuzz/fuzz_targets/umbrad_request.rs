//! One line a client sends umbrad: the JSON-RPC framing, then the params of the methods whose
//! params carry the most structure (a session start with its policy and approval settings, a
//! spawn, stdin data, network and permission answers, a configuration patch), validated as the
//! daemon validates them.
#![no_main]

use libfuzzer_sys::fuzz_target;
use umbra_api::methods::*;
use umbra_api::rpc::{decode_params, parse_request_line, Incoming};

fn params<M: Method>(value: Option<serde_json::Value>) -> Option<M::Params> {
    decode_params::<M::Params>(value).ok()
}

fn check(request: umbra_api::rpc::Request) {
    let value = request.params.clone();
    match request.method.as_str() {
        SessionStart::NAME => {
            if let Some(p) = params::<SessionStart>(value) {
                let _ = p.settings.applied_to(&umbra_api::SessionSettings::default());
            }
        }
        ProcessSpawn::NAME => drop(params::<ProcessSpawn>(value)),
        ProcessStdin::NAME => {
            if let Some(p) = params::<ProcessStdin>(value) {
                let _ = p.data.to_bytes();
            }
        }
        SessionSetNetwork::NAME => {
            if let Some(p) = params::<SessionSetNetwork>(value) {
                let _ = p.network.validate();
            }
        }
        PermissionRespond::NAME => drop(params::<PermissionRespond>(value)),
        ConfigSet::NAME => {
            if let Some(p) = params::<ConfigSet>(value) {
                let _ = umbra_api::DaemonConfig::default().patched(&p);
            }
        }
        _ => {}
    }
}

fuzz_target!(|data: &[u8]| {
    let requests = match parse_request_line(data) {
        Incoming::Single(r) => vec![r],
        Incoming::Batch(rs) => rs,
    };
    for request in requests.into_iter().flatten() {
        check(request);
    }
});
