// A Node.js `tls` client's first flight: node node_client.js PORT NAME.
const tls = require('tls');
const s = tls.connect({
  host: '127.0.0.1', port: +process.argv[2], servername: process.argv[3],
  rejectUnauthorized: false, ALPNProtocols: ['h2', 'http/1.1'],
});
s.on('error', () => {});
