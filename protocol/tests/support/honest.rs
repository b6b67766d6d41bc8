//! A round of devices 1..=n that all answer every stage, in one process:
//! the stages before and after the masked inputs, which the tests send
//! themselves (each its own way).

use std::collections::{BTreeMap, BTreeSet};

use canopy_protocol::auth::DeviceKey;
use canopy_protocol::device_cert::KeyTrust;
use canopy_protocol::secagg::{Aggregator, Client, Plan, Session};

pub struct HonestRound {
    pub server: Aggregator,
    /// Device i + 1's client and key.
    pub clients: Vec<Client>,
    pub keys: Vec<DeviceKey>,
}

impl HonestRound {
    /// Every device through AdvertiseKeys, ShareKeys and ShareCheck; the
    /// Exclusions message each device masks against comes back with it.
    pub fn start(
        session: Session,
        plan: &Plan,
        graph_seed: &[u8; 32],
        devices: usize,
    ) -> (HonestRound, BTreeMap<u64, Vec<u8>>) {
        let keys: Vec<DeviceKey> = (0..devices).map(|_| DeviceKey::generate()).collect();
        let public: Vec<(u64, [u8; 32])> = (1..)
            .zip(&keys)
            .map(|(id, key)| (id, key.public_key()))
            .collect();
        let mut server = Aggregator::new(session, plan.clone(), graph_seed, &public).unwrap();
        let mut clients = Vec::new();
        for (id, key) in (1..).zip(&keys) {
            let (client, advert) =
                Client::start(session, id, plan.clone(), key, KeyTrust::Server).unwrap();
            server.receive_advertisement(id, &advert).unwrap();
            clients.push(client);
        }
        for (id, message) in server.close_advertising().unwrap() {
            let reply = clients[id as usize - 1].share_keys(&message).unwrap();
            server.receive_shares(id, &reply).unwrap();
        }
        for (id, message) in server.close_sharing().unwrap() {
            let receipt = clients[id as usize - 1].check_shares(&message).unwrap();
            server.receive_share_receipt(id, &receipt).unwrap();
        }
        let exclusions = server.close_checking().unwrap();
        let round = HonestRound {
            server,
            clients,
            keys,
        };
        (round, exclusions)
    }

    /// After the masked inputs: every device signs the survivors and
    /// answers the unmasking. The unmasked sum and its survivors.
    pub fn finish(mut self) -> (Vec<u32>, BTreeSet<u64>) {
        for (id, message) in self.server.close_collection().unwrap() {
            let index = id as usize - 1;
            let reply = self.clients[index]
                .sign_survivors(&message, &self.keys[index])
                .unwrap();
            self.server.receive_survivor_signature(id, &reply).unwrap();
        }
        for (id, message) in self.server.close_consistency().unwrap() {
            let reply = self.clients[id as usize - 1].unmask(&message).unwrap();
            self.server.receive_unmask_response(id, &reply).unwrap();
        }
        self.server.finish().unwrap()
    }
}
