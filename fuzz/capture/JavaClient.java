// A Java (JSSE) client's first flight: java JavaClient.java PORT NAME.
import java.util.List;
import javax.net.ssl.*;

public class JavaClient {
    public static void main(String[] a) throws Exception {
        SSLContext ctx = SSLContext.getInstance("TLS");
        ctx.init(null, new TrustManager[] {new X509TrustManager() {
            public void checkClientTrusted(java.security.cert.X509Certificate[] c, String s) {}
            public void checkServerTrusted(java.security.cert.X509Certificate[] c, String s) {}
            public java.security.cert.X509Certificate[] getAcceptedIssuers() {
                return new java.security.cert.X509Certificate[0];
            }
        }}, null);
        SSLSocket s = (SSLSocket) ctx.getSocketFactory().createSocket("127.0.0.1", Integer.parseInt(a[0]));
        SSLParameters p = s.getSSLParameters();
        p.setServerNames(List.of(new SNIHostName(a[1])));
        p.setApplicationProtocols(new String[] {"h2", "http/1.1"});
        s.setSSLParameters(p);
        try {
            s.startHandshake();
        } catch (Exception e) {
        }
    }
}
