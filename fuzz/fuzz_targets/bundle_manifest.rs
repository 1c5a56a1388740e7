//! A bundle's manifest, as downloaded from a server: parsed and validated (sizes, digests,
//! artifact names and roles, versions) before anything is fetched.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(manifest) = umbra_bundle::Manifest::parse(data, "0.1.0") {
        // A manifest that passed must survive its own round trip.
        let again = umbra_bundle::Manifest::parse(manifest.to_json().as_bytes(), "0.1.0");
        assert!(again.is_ok(), "a valid manifest did not re-parse: {again:?}");
        let _ = (manifest.size_total(), manifest.compressed_total());
    }
});
