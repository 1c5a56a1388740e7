//! umbrad's configuration on disk: `$XDG_CONFIG_HOME/umbra/umbrad.json` (or `--config`).
//! Missing fields take their defaults; `config.set` writes the whole file back atomically.

use std::io::Write;
use std::path::{Path, PathBuf};

use umbra_api::DaemonConfig;

pub fn default_path() -> PathBuf {
    umbra_api::paths::config_dir().join("umbrad.json")
}

/// The configuration at `path`; defaults when there is no file. A file that is not valid is an
/// error: silently replacing a user's settings with defaults would lose them.
pub fn load(path: &Path) -> anyhow::Result<DaemonConfig> {
    match std::fs::read(path) {
        Ok(bytes) => {
            let config: DaemonConfig = serde_json::from_slice(&bytes)
                .map_err(|e| anyhow::anyhow!("{} is not a valid umbrad configuration: {e}", path.display()))?;
            // Checked now: a value out of range would otherwise fail every session start.
            config.validate().map_err(|e| anyhow::anyhow!("{}: {}", path.display(), e.message))?;
            Ok(config)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(DaemonConfig::default()),
        Err(e) => Err(anyhow::anyhow!("cannot read {}: {e}", path.display())),
    }
}

pub fn save(path: &Path, config: &DaemonConfig) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension("json.tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(&serde_json::to_vec_pretty(config).expect("config serializes"))?;
    f.write_all(b"\n")?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_means_defaults_and_invalid_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("umbrad.json");
        assert_eq!(load(&path).unwrap(), DaemonConfig::default());
        let mut config = DaemonConfig::default();
        config.session.cpus = 3;
        save(&path, &config).unwrap();
        assert_eq!(load(&path).unwrap().session.cpus, 3);
        std::fs::write(&path, b"{\"cpus\": \"many\"}").unwrap();
        assert!(load(&path).unwrap_err().to_string().contains("not a valid"));
        std::fs::write(&path, b"{\"cpus\": 0}").unwrap();
        assert!(load(&path).unwrap_err().to_string().contains("cpus"), "out of range is refused at load");
    }
}
