//! A link CA of a test's own, and leaf certificates of chosen extended key usages and
//! lifetimes: for tests that cross the link's certificate checks (clientAuth, expiry, renewal).

use std::time::Duration;

/// A CA (its PEM and its signing half).
pub struct TestPki {
    /// The CA certificate, PEM.
    pub ca: String,
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
}

impl TestPki {
    /// A new self-signed CA.
    pub fn new() -> anyhow::Result<TestPki> {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
        let mut ca = CertificateParams::new(Vec::<String>::new())?;
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, "test link CA");
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate()?;
        let cert = ca.self_signed(&key)?;
        Ok(TestPki {
            ca: cert.pem(),
            issuer: rcgen::Issuer::new(ca, key),
        })
    }

    /// (cert PEM, key PEM) for `names` with extended key usages `eku` (none: no extension),
    /// valid from a minute ago until `lifetime` from now (`None`: rcgen's far future).
    pub fn leaf(
        &self,
        names: &[&str],
        eku: Vec<rcgen::ExtendedKeyUsagePurpose>,
        lifetime: Option<Duration>,
    ) -> anyhow::Result<(String, String)> {
        let mut params = rcgen::CertificateParams::new(
            names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>(),
        )?;
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "test leaf");
        params.use_authority_key_identifier_extension = true;
        params.key_usages = vec![rcgen::KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = eku;
        if let Some(lifetime) = lifetime {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?;
            let epoch = rcgen::date_time_ymd(1970, 1, 1);
            params.not_before = epoch + now.saturating_sub(Duration::from_secs(60));
            params.not_after = epoch + now + lifetime;
        }
        let key = rcgen::KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok((cert.pem(), key.serialize_pem()))
    }
}
