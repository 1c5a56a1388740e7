//! `session.start {image}`: the OCI image made a bundle (`umbra_runtime::oci`), found again if
//! it was converted before, pulled with this user's Docker credentials otherwise. Its base is
//! the configured bundle, whose kernel and agent it boots with.

use umbra_api::{ApiError, ErrorCode};
use umbra_runtime::oci::{ObtainOptions, OciError};

use crate::state::Daemon;

/// The installed bundle for `reference`.
pub async fn bundle_for(daemon: &Daemon, reference: &str) -> Result<String, ApiError> {
    let config = daemon.manager.config();
    // Read when the bundle is signed: the first conversion makes this machine's key.
    let trust = || {
        let system = daemon.manager.system_policy();
        umbra_runtime::bundle_trust::trust(
            system.as_ref().map(|s| &s.policy),
            &daemon.manager.config().trusted_keys,
            &[],
            &umbra_api::paths::trusted_keys_dir(),
            false,
        )
    };
    let opts = ObtainOptions {
        base: Some(config.session.bundle.clone()),
        allow_http_loopback: daemon.options.allow_http_loopback,
        ..ObtainOptions::default()
    };
    let mut progress = |line: String| tracing::info!("image {reference}: {line}");
    match umbra_runtime::oci::bundle_for(reference, &opts, &trust, &mut progress).await {
        Ok((version, _)) => Ok(version),
        Err(e @ OciError::Image(umbra_image::ImageError::Invalid(_))) => Err(ApiError::invalid_params(e.to_string())),
        Err(e) => Err(ApiError::new(ErrorCode::BundleError, format!("image {reference}: {e}"))),
    }
}
