//! umbra-fsd's seccomp filter: once virtiofsd runs and the hide thread waits, the process only
//! reads requests, mounts and unmounts in its namespace, walks shares, answers fanotify events,
//! and stops virtiofsd. Everything else kills it. The filter is data (`seccomp.json`, each
//! syscall with its reason); `UMBRA_FSD_SECCOMP=log` allows and logs instead (kernel audit,
//! `dmesg`), `off` installs none.

const FILTER_JSON: &str = include_str!("seccomp.json");

/// Installs the filter on every thread of the process (the hide thread too).
pub fn install() -> Result<(), String> {
    let mode = std::env::var("UMBRA_FSD_SECCOMP").unwrap_or_default();
    if mode == "off" {
        return Ok(());
    }
    let mut json: serde_json::Value = serde_json::from_str(FILTER_JSON).map_err(|e| format!("seccomp filter: {e}"))?;
    if let Some(filter) = json["fsd"].as_object_mut() {
        filter.remove("comment");
        if mode == "log" {
            filter.insert("mismatch_action".into(), "log".into());
        }
    }
    let arch = std::env::consts::ARCH.try_into().map_err(|e| format!("seccomp filter: {e:?}"))?;
    let filters = seccompiler::compile_from_json(json.to_string().as_bytes(), arch)
        .map_err(|e| format!("seccomp filter: {e}"))?;
    seccompiler::apply_filter_all_threads(&filters["fsd"]).map_err(|e| format!("install the seccomp filter: {e}"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_filter_compiles_and_every_rule_says_why() {
        let json: serde_json::Value = serde_json::from_str(super::FILTER_JSON).unwrap();
        let filter = &json["fsd"];
        assert_eq!(filter["mismatch_action"], "kill_process");
        let rules = filter["filter"].as_array().unwrap();
        for rule in rules {
            assert!(rule["comment"].as_str().is_some_and(|c| !c.is_empty()), "{rule}");
            let name = rule["syscall"].as_str().unwrap();
            assert!(!["clone", "clone3", "fork", "vfork", "execve", "ptrace"].contains(&name), "{name}");
        }
    }
}
